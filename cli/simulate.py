"""``fusekit simulate``: train simulated clients and write one checkpoint per client."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fusekit._cli.options import (
    ClassesOption,
    DataDirOption,
    DataOption,
    DataPathOption,
    DeviceOption,
    FeaturesOption,
    JsonOption,
    SamplesOption,
)
from fusekit._cli.output import emit_json, stderr, stdout
from fusekit.core.arch import describe_arch


def simulate(
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder for the checkpoints.")],
    data: DataOption = "digits",
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
    device: DeviceOption = "auto",
    force: Annotated[bool, typer.Option("--force", help="Replace existing client files.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Split a data set across simulated clients, train one model each, write checkpoints."""
    from fusekit.toolkit.data import load_dataset
    from fusekit.toolkit.simulate import SimulationConfig, client_archs, simulate_clients
    from fusekit.toolkit.train import FedNLRConfig, TrainConfig

    dataset = load_dataset(
        data,
        data_dir=data_dir,
        path=data_path,
        samples=samples,
        features=features,
        classes=classes,
        seed=seed,
    )
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
    columns = (
        TextColumn("training clients"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=stderr, transient=True) as progress:
        task = progress.add_task("clients", total=clients)
        trained = simulate_clients(
            dataset,
            config,
            out_dir=out,
            device=device,
            force=force,
            on_client=lambda _client: progress.advance(task),
        )
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
