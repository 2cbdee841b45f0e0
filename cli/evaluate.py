"""``fusekit evaluate``: accuracy and loss of client and fused models, and the ensemble."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from fusekit._cli.options import (
    ClassesOption,
    DataDirOption,
    DataOption,
    DataPathOption,
    DataSeedOption,
    DeviceOption,
    FeaturesOption,
    JsonOption,
    NormalizeOption,
    SamplesOption,
    dataset_option,
    described,
    normalization_option,
)
from fusekit._cli.output import emit_json, stdout, step_progress


def evaluate(
    files: Annotated[
        list[Path], typer.Argument(help="Client and fused checkpoints.", show_default=False)
    ],
    data: DataOption = None,
    data_dir: DataDirOption = None,
    data_path: DataPathOption = None,
    samples: SamplesOption = 10_000,
    features: FeaturesOption = 20,
    classes: ClassesOption = 10,
    seed: DataSeedOption = 0,
    normalize: NormalizeOption = None,
    device: DeviceOption = "auto",
    batch_size: Annotated[int, typer.Option("--batch-size", help="Inference batch size.")] = 4096,
    as_json: JsonOption = False,
) -> None:
    """Test accuracy and loss of every model, plus the logit- and softmax-average ensembles.

    The data is used as stored; each model normalises it as its checkpoint records
    (fusekit.preprocess), or as --normalize says for models that record nothing."""
    from fusekit.toolkit.evaluate import evaluate_checkpoints

    dataset = dataset_option(data, data_dir, data_path, samples, features, classes, seed)
    normalization = normalization_option(normalize)
    models = [described(path, normalization) for path in files]
    with step_progress("evaluate"):
        report = evaluate_checkpoints(models, dataset, device=device, batch_size=batch_size)
    if as_json:
        emit_json(report.as_dict())
        return
    table = Table(
        "model",
        "kind",
        "accuracy",
        "loss",
        title=f"{dataset.name} test set ({len(dataset.y_test)} samples, {report.device})",
    )
    for score in report.scores:
        kind = f"fused ({score.method})" if score.method else score.kind
        table.add_row(score.name, kind, f"{score.accuracy:.2%}", f"{score.loss:.4f}")
    if report.mean_client_accuracy is not None:
        table.add_section()
        table.add_row("mean of clients", "client", f"{report.mean_client_accuracy:.2%}", "")
    stdout.print(table)
