"""``fusekit demo``: the main job, simulate -> fuse with every method -> evaluate."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from fusekit._cli.options import AlignOption, CalibrateOption, DeviceOption, JsonOption
from fusekit._cli.output import emit_json, stderr, stdout, step_progress


def demo(
    clients: Annotated[int, typer.Option("--clients", help="Number of clients.")] = 8,
    alpha: Annotated[float, typer.Option("--alpha", help="Dirichlet concentration.")] = 0.5,
    arch: Annotated[str, typer.Option("--arch", help="Client architecture.")] = "mlp:100",
    epochs: Annotated[int, typer.Option("--epochs", help="Local epochs.")] = 20,
    lr: Annotated[float, typer.Option("--lr", help="Adam learning rate.")] = 3e-3,
    seed: Annotated[int, typer.Option("--seed", help="Seed of everything.")] = 0,
    method: Annotated[
        list[str] | None,
        typer.Option("--method", "-m", help="Only these methods [default: every registered one]."),
    ] = None,
    device: DeviceOption = "auto",
    batchnorm: Annotated[
        bool, typer.Option("--batchnorm", help="MLP clients with BatchNorm.")] = False,
    calibrate: CalibrateOption = False,
    align: AlignOption = False,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Keep client and fused checkpoints here.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace files in --out.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Simulate clients on digits (Dirichlet split), fuse them with every method, evaluate."""
    from fusekit.toolkit.demo import DemoConfig, run_demo
    config = DemoConfig(
        clients=clients,
        alpha=alpha,
        arch=arch,
        epochs=epochs,
        lr=lr,
        seed=seed,
        methods=method or None,
        device=device,
        batchnorm=batchnorm,
        calibrate=calibrate,
        align=align,
    )
    with step_progress("demo"):
        report = run_demo(config, out_dir=out, force=force)
    if as_json:
        emit_json(report.as_dict())
    else:
        stdout.print(demo_table(report))
        kept = (f"checkpoints kept in {out}/clients and {out}/fused-<method>.safetensors"
                if out is not None else "checkpoints were written to a temporary folder and "
                "deleted; --out DIR keeps them")
        stderr.print(kept, highlight=False)
    if report.failed:
        raise typer.Exit(1)


# The columns --calibrate and --align add: title, DemoConfig flag, MethodRun score.
PROTOCOL_COLUMNS = (("calibrated", "calibrate", "calibrated"),
                    ("aligned + refit", "align", "aligned"))


def demo_table(report) -> Table:
    c = report.config
    protocols = [(title, score) for title, flag, score in PROTOCOL_COLUMNS if getattr(c, flag)]
    extra = [""] * len(protocols)
    table = Table(
        "model", "accuracy", "loss", "widths", "time", *(title for title, _ in protocols),
        title=f"{c.clients} clients on {c.data}, {c.partition} alpha={c.alpha}, {c.arch}"
        f"{' + BatchNorm' if c.batchnorm else ''}, {c.epochs} epochs, seed {c.seed} "
        f"({report.device})", show_edge=False,  # 80 columns hold every column's heading
    )
    accs = [s.accuracy for s in report.clients]
    table.add_row(
        "clients (mean)",
        f"{report.mean_client_accuracy:.2%}",
        f"{sum(s.loss for s in report.clients) / len(report.clients):.4f}",
        f"{min(accs):.0%}..{max(accs):.0%} acc",
        f"{report.simulate_time_s:.1f} s train",
        *extra,
    )
    if report.ensemble is not None:
        table.add_row(
            "ensemble (logits)",
            f"{report.ensemble.accuracy:.2%}",
            f"{report.ensemble.loss:.4f}",
            "",
            "",
            *extra,
        )
    for column in table.columns[-len(protocols) or len(table.columns):]:
        # A narrow terminal wraps these headings, it never cuts their words ("calibra…").
        column.min_width = max(map(len, str(column.header).split()))
    table.add_section()
    for run in report.methods:
        if run.error is not None:
            table.add_row(escape(run.method), "[red]failed[/]", "", escape(run.error[:60]), "",
                          *extra)
            continue
        shown = [f"{score.accuracy:.2%}" if (score := getattr(run, name)) else "-"
                 for _, name in protocols]
        table.add_row(
            run.method,
            f"{run.score.accuracy:.2%}",
            f"{run.score.loss:.4f}",
            ", ".join(map(str, run.widths)),
            f"{run.fuse_time_s:.3f} s",
            *shown,
        )
    return table
