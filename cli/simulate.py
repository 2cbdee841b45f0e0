"""``fusekit simulate``: train simulated clients and write one checkpoint per client, or,
with ``--rounds``, run rounds of local training and fusion and write the global model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from fusekit._cli.options import (
    AlignOption,
    CalibrateOption,
    ClassesOption,
    DataDirOption,
    DataOption,
    DataPathOption,
    DeviceOption,
    FeaturesOption,
    JsonOption,
    NormalizeOption,
    SamplesOption,
    dataset_option,
    normalization_option,
)
from fusekit._cli.output import emit_json, stdout, step_progress
from fusekit.core.errors import ParameterError

if TYPE_CHECKING:
    from fusekit.toolkit.data import Dataset
    from fusekit.toolkit.rounds import RoundsConfig


def simulate(
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder for the checkpoints.")],
    data: DataOption = None,
    data_dir: DataDirOption = None,
    data_path: DataPathOption = None,
    clients: Annotated[int, typer.Option("--clients", help="Number of clients S.")] = 10,
    partition: Annotated[
        str, typer.Option("--partition", help="iid, dirichlet (hetero-dir) or labels.")
    ] = "dirichlet",
    alpha: Annotated[float, typer.Option("--alpha", help="dirichlet: concentration.")] = 0.5,
    min_classes: Annotated[
        int | None, typer.Option("--min-classes", help="labels: fewest classes per client.")
    ] = None,
    max_classes: Annotated[
        int | None, typer.Option("--max-classes", help="labels: most classes per client.")
    ] = None,
    min_samples: Annotated[
        int, typer.Option("--min-samples", help="Minimum samples per client.")
    ] = 10,
    arch: Annotated[
        list[str],
        typer.Option(
            "--arch",
            help="mlp:W1,W2,... or conv:C1,C2 (add /W1,... for linear layers); repeat "
            "once per client for heterogeneous clients.",
        ),
    ] = ["mlp:100"],  # noqa: B006 - typer needs a literal default
    batchnorm: Annotated[
        bool, typer.Option("--batchnorm", help="MLP: BatchNorm after hidden layers.")
    ] = False,
    pan: Annotated[
        str, typer.Option("--pan", help="Position-aware neurons: none, multiplicative, additive.")
    ] = "none",
    pan_amplitude: Annotated[float, typer.Option("--pan-amplitude", help="PAN amplitude A.")] = 0.1,
    pan_period: Annotated[float, typer.Option("--pan-period", help="PAN period T.")] = 1.0,
    shared_init: Annotated[
        bool, typer.Option("--shared-init", help="Start every client from the same weights.")
    ] = False,
    epochs: Annotated[int, typer.Option("--epochs", help="Local epochs.")] = 20,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Mini-batch size.")] = 32,
    optimizer: Annotated[str, typer.Option("--optimizer", help="adam or sgd.")] = "adam",
    lr: Annotated[
        float | None, typer.Option("--lr", help="Learning rate [adam 3e-3, sgd 0.05].")
    ] = None,
    fed2: Annotated[
        bool,
        typer.Option("--fed2", help="Fed² structure: the last --fed2-depth layers in groups."),
    ] = False,
    fed2_groups: Annotated[
        int | None,
        typer.Option("--fed2-groups", help="Fed²: groups G [default: one per class]."),
    ] = None,
    fed2_depth: Annotated[
        int, typer.Option("--fed2-depth", help="Fed²: decoupled layers, logit layer included.")
    ] = 2,
    rounds: Annotated[
        int | None,
        typer.Option(
            "--rounds",
            help="Run R rounds of local training from the global model and fusion; writes "
            "OUT/global.safetensors and OUT/rounds.json instead of client files.",
        ),
    ] = None,
    method: Annotated[
        str,
        typer.Option(
            "--method",
            "-m",
            help="--rounds: fusion method (avg and fed2 every round; pfnm, nafi, ot fuse "
            "round 1, then avg).",
        ),
    ] = "avg",
    clients_per_round: Annotated[
        int | None,
        typer.Option("--clients-per-round", help="--rounds: clients sampled per round [all]."),
    ] = None,
    calibrate: CalibrateOption = False,
    align: AlignOption = False,
    fednlr: Annotated[
        bool,
        typer.Option(
            "--fednlr",
            help="FedNLR neuron-wise learning rates (needs --optimizer sgd; implies "
            "--shared-init).",
        ),
    ] = False,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of partition, init and data order.")
    ] = 0,
    samples: SamplesOption = 10_000,
    features: FeaturesOption = 20,
    classes: ClassesOption = 10,
    normalize: NormalizeOption = None,
    device: DeviceOption = "auto",
    force: Annotated[bool, typer.Option("--force", help="Replace existing client files.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Train simulated clients and write their checkpoints, or run federated rounds (--rounds).

    Each client trains on its own part of the data (Dirichlet, label-skew or iid split)."""
    if rounds is None and (method != "avg" or clients_per_round is not None or calibrate
                           or align):
        raise ParameterError("--method, --clients-per-round, --calibrate and --align: only "
                             "with --rounds R (with them the sampled clients calibrate each "
                             "round's fused model)")
    from fusekit.toolkit.rounds import RoundsConfig
    from fusekit.toolkit.simulate import SimulationConfig, client_archs, simulate_clients
    from fusekit.toolkit.train import FedNLRConfig, TrainConfig

    dataset = dataset_option(data, data_dir, data_path, samples, features, classes, seed)
    if normalize:  # what the clients train with and record (fusekit.preprocess)
        dataset = dataclasses.replace(dataset, normalization=normalization_option(normalize))
    pan_settings = (
        None if pan == "none" else {"mode": pan, "amplitude": pan_amplitude, "period": pan_period}
    )
    config = SimulationConfig(
        clients=clients,
        partition=partition,
        alpha=alpha,
        min_classes=min_classes,
        max_classes=max_classes,
        min_samples=min_samples,
        arch=arch[0] if len(arch) == 1 else arch,
        batchnorm=batchnorm,
        pan=pan_settings,
        fed2={"groups": fed2_groups or dataset.num_classes, "depth": fed2_depth} if fed2 else None,
        shared_init=shared_init or fednlr,
        train=TrainConfig(
            epochs=epochs,
            batch_size=batch_size,
            lr=lr if lr is not None else (3e-3 if optimizer == "adam" else 0.05),
            optimizer=optimizer,
            fednlr=FedNLRConfig() if fednlr else None,
        ),
        seed=seed,
    )
    client_archs(config, dataset)  # reject a bad --arch before any training
    if rounds is not None:
        rounds_config = RoundsConfig(rounds=rounds, method=method,
                                     clients_per_round=clients_per_round, simulation=config,
                                     calibrate=calibrate, align=align)
        _run_rounds(dataset, rounds_config, out, device, force, as_json)
        return
    with step_progress("simulate"):
        trained = simulate_clients(dataset, config, out_dir=out, device=device, force=force)
    from fusekit.core.arch import describe_arch

    rows = [
        {
            "path": str(c.path),
            "samples": len(c.indices),
            "classes": int((c.checkpoint.class_counts > 0).sum()),
            "arch": describe_arch(c.checkpoint.arch),
            "final_loss": c.training.epoch_losses[-1],
        }
        for c in trained
    ]
    if as_json:
        emit_json({"data": dataset.name, "clients": rows})
        return
    table = Table(
        "checkpoint",
        "samples",
        "classes",
        "arch",
        "final loss",
        title=f"{clients} clients on {dataset.name} ({partition})",
    )
    for row in rows:
        table.add_row(
            row["path"],
            str(row["samples"]),
            str(row["classes"]),
            row["arch"],
            f"{row['final_loss']:.4f}",
        )
    stdout.print(table)


def _run_rounds(dataset: Dataset, config: RoundsConfig, out: Path, device: str, force: bool,
                as_json: bool) -> None:
    from fusekit.core.checkpoint import save_checkpoint, write_atomic
    from fusekit.core.errors import OutputError
    from fusekit.toolkit.rounds import run_rounds

    model_path, log_path = out / "global.safetensors", out / "rounds.json"
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: --out must be a directory, found a file")
    for path in (model_path, log_path):
        if path.exists() and not force:
            raise OutputError(f"{path}: output file exists; pass --force to replace it")
    with step_progress("simulate"):
        result = run_rounds(dataset, config, device=device)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = result.global_checkpoint
    save_checkpoint(model_path, checkpoint.state_dict(), checkpoint.metadata, force=force)
    summary = {
        "data": dataset.name,
        "method": config.method,
        "global": str(model_path),
        "log": str(log_path),
        **result.as_dict(),
    }
    write_atomic(log_path, (json.dumps(summary, indent=2) + "\n").encode(), force=force)
    if as_json:
        emit_json(summary)
        return
    from rich.table import Table

    calibrated = config.calibrate or config.align
    before = ["uncal."] if calibrated else []
    protocol = ", aligned + refit" if config.align else ", calibrated" if calibrated else ""
    table = Table("round", "method", "clients", *before, "accuracy", "loss", "drift",
                  "dislocated", title=f"{config.rounds} rounds on {dataset.name}{protocol} -> {model_path}")
    for log in result.rounds:
        uncalibrated = ("-" if log.uncalibrated_accuracy is None
                        else f"{log.uncalibrated_accuracy:.4f}")
        table.add_row(str(log.round), log.method, str(len(log.clients)),
                      *([uncalibrated] if calibrated else []), f"{log.accuracy:.4f}",
                      f"{log.loss:.4f}", f"{log.drift:.4f}", f"{100 * log.dislocated:.1f}%")
    stdout.print(table)
