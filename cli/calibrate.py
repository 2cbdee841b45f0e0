"""``fusekit stats`` (run by a client on its own data) and ``fusekit calibrate`` (run by
whoever fused): calibration from per-channel statistics, ALGORITHMS.md §12."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from fusekit._cli.options import (
    ClassesOption,
    DATA_CHOICES,
    DATA_DEFAULT,
    DataDirOption,
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
from fusekit._cli.output import emit_json, stdout
from fusekit.core.cross_stats import DEFAULT_RIDGE
from fusekit.core.errors import DataError, ParameterError
from fusekit.core.stats import BN_INPUT, DEFAULT_MIN_SAMPLES, MODES

log = logging.getLogger(__name__)

ClientDataOption = Annotated[str | None, typer.Option(
    "--data", help=f"{DATA_CHOICES}, or tokens (x_train of --data-path as token ids, for a "
    f"token transformer) {DATA_DEFAULT}; its training inputs are used.", show_default=False)]
OutputOption = Annotated[
    Path, typer.Option("--output", "-o", help="The .safetensors file to write.",
                       show_default=False)
]
ClientModelsArgument = Annotated[list[Path], typer.Argument(
    help="The clients' own models (the fusion's inputs).", metavar="CLIENTS...",
    show_default=False)]
ForceOption = Annotated[bool, typer.Option("--force", help="Replace an existing output file.")]
MinSamplesOption = Annotated[
    int, typer.Option("--min-samples", help="Refuse statistics over fewer inputs (privacy: "
                      "the moments of a few samples reveal them).")
]


def stats(
    model: Annotated[Path, typer.Argument(help="The model (.safetensors, or a Hugging Face "
                                          "model folder): the fused model sent back for "
                                          "calibration, or the client's own model (REPAIR's "
                                          "targets).", show_default=False)],
    output: OutputOption,
    data: ClientDataOption = None,
    data_dir: DataDirOption = None,
    data_path: DataPathOption = None,
    samples: SamplesOption = 10_000,
    features: FeaturesOption = 20,
    classes: ClassesOption = 10,
    seed: DataSeedOption = 0,
    mode: Annotated[str, typer.Option(
        "--mode", metavar="|".join(MODES),
        help="eval: the model as it is (exact once the layers below are calibrated); batch: "
        "every BatchNorm normalised with the batch's statistics (one-pass calibration).")
    ] = "eval",
    batch_size: Annotated[int, typer.Option("--batch-size", help="Inputs per forward pass.")
                          ] = 1024,
    device: DeviceOption = "cpu",
    min_samples: MinSamplesOption = DEFAULT_MIN_SAMPLES,
    against: Annotated[Path | None, typer.Option(
        "--against", help="The client's own model: write cross statistics of MODEL (the "
        "reference sent for an alignment round) and this model instead (fusekit align).",
        show_default=False)] = None,
    layer: Annotated[str | None, typer.Option(
        "--layer", help="With --against: write refit statistics of this layer of MODEL "
        "instead (one refit round, fusekit refit).", show_default=False)] = None,
    input_moments: Annotated[bool, typer.Option(
        "--input-moments", help="Also record the first layer's input moments (count, mean, "
        "d x d covariance), sent with the statistics of the client's own model: calibrate "
        "then derives the fused first layer without a round. They say more about the data "
        "than per-channel moments (docs/calibration.md).")] = False,
    normalize: NormalizeOption = None,
    force: ForceOption = False,
    as_json: JsonOption = False,
) -> None:
    """Per-channel count, mean and variance of MODEL's layers on this client's data (its
    training inputs).

    Every hidden pre-activation and BatchNorm input: all that leaves the client. With
    --against OWN_MODEL: per hidden layer, the covariances of MODEL's channels with
    OWN_MODEL's (an alignment round); with --layer NAME as well: the moments that refit
    that layer (a refit round). The data is used as stored; each model normalises it as
    its checkpoint records (fusekit.preprocess), or as --normalize says."""
    normalization = normalization_option(normalize)
    name, inputs = client_inputs(data, data_dir, data_path, samples, features, classes, seed)
    if against is not None:
        if input_moments:
            raise ParameterError("--input-moments: recorded with a model's statistics; "
                                 "cross statistics (--against) do not carry them")
        if mode != "eval":
            raise ParameterError(f"--mode {mode}: cross statistics (--against) run both "
                                 "models as they are; expected --mode eval")
        _cross_stats(model, against, normalization, inputs, name, output, layer,
                     batch_size=batch_size, device=device, min_samples=min_samples,
                     force=force, as_json=as_json)
        return
    if layer is not None:
        raise ParameterError("--layer: refit statistics pair MODEL with the client's own "
                             "model; give it with --against OWN_MODEL")
    from fusekit.core.stats import save_statistics
    from fusekit.toolkit.calibration import client_statistics

    try:
        result = client_statistics(described(model, normalization), inputs, mode=mode,
                                   batch_size=batch_size, device=device,
                                   min_samples=min_samples, input_moments=input_moments)
    except DataError as exc:  # name the option, not the library's argument
        raise DataError(str(exc).replace("(min_samples)", "(--min-samples)")) from None
    _something_to_calibrate(result, model)
    if mode == "batch" and not any(point.startswith(f"{BN_INPUT}:") for point in result.points):
        log.warning("%s: no BatchNorm, so --mode batch computes what --mode eval does",
                    model)
    written = save_statistics(output, result, force=force)
    summary = {"output": str(written), "model": result.model, "samples": result.num_samples,
               "mode": result.mode, "points": len(result.points),
               "input_moments": sorted(result.inputs)}
    if as_json:
        emit_json(summary)
    else:
        extra = " and the first layer's input moments" if result.inputs else ""
        stdout.print(f"wrote {written}: {len(result.points)} points{extra} over "
                     f"{result.num_samples} inputs of {name} (model {result.model[:12]})",
                     highlight=False)


def _something_to_calibrate(result, model: Path) -> None:
    """Refuse statistics of no point (a model without a hidden layer): nothing they could
    calibrate, align or refit."""
    if not result.points:
        raise ParameterError(f"{model}: no hidden layer, so nothing to calibrate or align; "
                             "no statistics written")


def client_inputs(data: str | None, data_dir: Path | None, data_path: Path | None,
                  samples: int = 10_000, features: int = 20, classes: int = 10,
                  seed: int = 0):
    """The data set's name and the training inputs a client computes statistics on (the
    ``--data`` options, or token ids for a token transformer; a synthetic set's options
    at ``fusekit stats``'s defaults unless given)."""
    from fusekit.toolkit.data import dataset_name, token_ids

    name = dataset_name(data, data_path)
    if name == "tokens":
        if data_path is None:
            raise ParameterError("--data tokens: give the .npz of token ids with --data-path")
        return name, token_ids(data_path)
    return name, dataset_option(name, data_dir, data_path, samples, features, classes,
                                seed).x_train


def _cross_stats(reference: Path, own: Path, normalization, inputs, name: str, output: Path,
                 layer: str | None, *, batch_size: int, device: str, min_samples: int,
                 force: bool, as_json: bool) -> None:
    from fusekit.core.cross_stats import save_cross_statistics, save_refit_statistics
    from fusekit.toolkit.alignment import cross_statistics, refit_statistics

    options = {"batch_size": batch_size, "device": device, "min_samples": min_samples}
    models = described(reference, normalization), described(own, normalization)
    try:
        if layer is None:
            result = cross_statistics(*models, inputs, **options)
        else:
            result = refit_statistics(*models, inputs, layer, **options)
    except DataError as exc:  # name the option, not the library's argument
        raise DataError(str(exc).replace("(min_samples)", "(--min-samples)")) from None
    if layer is None:
        _something_to_calibrate(result, reference)
        written = save_cross_statistics(output, result, force=force)
        what = f"cross statistics of {len(result.points)} layers"
    else:
        written = save_refit_statistics(output, result, force=force)
        what = f"refit statistics of layer {layer}"
    summary = {"output": str(written), "reference": result.reference, "model": result.model,
               "samples": result.num_samples, "layer": layer}
    if as_json:
        emit_json(summary)
    else:
        stdout.print(f"wrote {written}: {what} over {result.num_samples} inputs of {name} "
                     f"(fused model {result.reference[:12]}, own model {result.model[:12]})",
                     highlight=False)


def calibrate(
    fused: Annotated[Path, typer.Argument(help="The fused model (.safetensors, or a Hugging "
                                          "Face model folder).", show_default=False)],
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="The .safetensors file to write (a folder for a Hugging Face "
        "model).", show_default=False)],
    statistics: Annotated[list[Path] | None, typer.Argument(
        help="Each client's statistics of FUSED (fusekit stats FUSED ...); none: the first "
        "layer alone, from the input moments --targets carry (stats --input-moments).",
        metavar="[STATS]...", show_default=False)] = None,
    targets: Annotated[list[Path] | None, typer.Option(
        "--targets", help="A client's statistics of its own model (repeat per client): "
        "REPAIR's targets for layers without BatchNorm (a transformer's MLPs and LayerNorms: "
        "required there); with input moments, the first layer without a round.",
        show_default=False)] = None,
    layers: Annotated[str | None, typer.Option(
        "--layers", help="Comma-separated layer names to calibrate (one layer-by-layer "
        "round; a transformer's MLP input layers and LayerNorms by their module names); "
        "default: all.", show_default=False)] = None,
    min_samples: MinSamplesOption = DEFAULT_MIN_SAMPLES,
    paired: Annotated[bool, typer.Option(
        "--paired", help="The k-th STATS and the k-th --targets are one client's, on the same "
        "data: REPAIR reads each fused neuron on the data of the clients matched into it "
        "(ALGORITHMS.md §12).")] = False,
    force: ForceOption = False,
    as_json: JsonOption = False,
) -> None:
    """Calibrate a fused model with its clients' statistics (BatchNorms restored, REPAIR).

    Pools the statistics exactly; --targets adds REPAIR to the layers without BatchNorm."""
    import fusekit
    from fusekit._cli import next_round  # imports the library: not at --help

    from fusekit.core.transformer import TransformerSpec

    result = fusekit.calibrate(fused, statistics or (), targets=targets or (),
                               layers=layers.split(",") if layers else None,
                               min_samples=min_samples, paired=paired)
    written = result.save(output, force=force)
    report = {"output": str(written), **result.report["calibration"]}
    if not isinstance(result.spec, TransformerSpec):
        report["next"] = next_round.after_calibration(
            output, result.spec, None if report["layers"] == "all" else report["layers"],
            statistics or [], targets or [], paired)
    _report(report, f"wrote {written}: calibrated with {report['clients']} client(s), "
            f"{report['samples']} inputs ({report['mode']} statistics"
            f"{', REPAIR targets' if report['repair'] else ''}"
            f"{', paired' if report.get('paired') else ''})", as_json)


def _report(report: dict, line: str, as_json: bool) -> None:
    """The step's report as JSON, or its line and the next round's commands."""
    if as_json:
        emit_json(report)
        return
    stdout.print(line, highlight=False)
    if "next" in report:
        from fusekit._cli import next_round
        stdout.print("\n".join(next_round.lines(report["next"])), highlight=False,
                     soft_wrap=True)


def align(
    reference: Annotated[Path, typer.Argument(
        help="The fused model the clients ran (.safetensors; calibrated first).",
        show_default=False)],
    clients: ClientModelsArgument,
    output: OutputOption,
    cross_stats: Annotated[list[Path], typer.Option(
        "--cross-stats", help="A client's cross statistics (fusekit stats REFERENCE "
        "--against OWN_MODEL ...), one per client (repeat).", show_default=False)],
    min_samples: MinSamplesOption = DEFAULT_MIN_SAMPLES,
    force: ForceOption = False,
    as_json: JsonOption = False,
) -> None:
    """Re-match every client to REFERENCE by activations and re-fuse (an alignment round).

    Writes the re-fused model at REFERENCE's widths and prints the first refit round: the
    refit rounds start from this model as written (each refit folds its layer's BatchNorm),
    as fusekit.toolkit.local.align_locally does; calibrate it instead to stop here."""
    import fusekit
    from fusekit._cli import next_round  # imports the library: not at --help

    result = fusekit.align(reference, clients, cross_stats, min_samples=min_samples)
    result.inputs += [path.absolute() for path in [reference, *cross_stats]]
    written = result.save(output, force=force)
    report = {"output": str(written), "clients": len(clients), "widths": result.widths,
              "mean_correlation": result.report["alignment"]["mean_correlation"],
              "next": next_round.after_alignment(output, result.spec, clients)}
    _report(report, f"wrote {written}: {len(clients)} client(s) re-matched to {reference} "
            f"(mean matched correlation {report['mean_correlation']}), widths "
            f"{result.widths}", as_json)


def refit(
    fused: Annotated[Path, typer.Argument(
        help="The aligned fused model the clients ran (.safetensors).", show_default=False)],
    clients: ClientModelsArgument,
    output: OutputOption,
    refit_stats: Annotated[list[Path], typer.Option(
        "--refit-stats", help="A client's refit statistics of one layer (fusekit stats FUSED "
        "--against OWN_MODEL --layer NAME ...), one per client (repeat).",
        show_default=False)],
    ridge: Annotated[float, typer.Option(
        "--ridge", help="Relative ridge towards the layer's current weights.")
    ] = DEFAULT_RIDGE,
    min_samples: MinSamplesOption = DEFAULT_MIN_SAMPLES,
    force: ForceOption = False,
    as_json: JsonOption = False,
) -> None:
    """Refit one layer of FUSED to the matched clients' pre-activations (a refit round).

    One round per layer, input to output: the next layer's statistics are computed with
    the model this writes."""
    import fusekit
    from fusekit._cli import next_round  # imports the library: not at --help

    result = fusekit.refit(fused, clients, refit_stats, ridge=ridge, min_samples=min_samples)
    result.inputs += [path.absolute() for path in [fused, *refit_stats]]
    written = result.save(output, force=force)
    report = {"output": str(written), **result.report["refit"]}
    report["next"] = next_round.after_refit(output, result.spec, clients, report["layers"][-1])
    _report(report, f"wrote {written}: layer {report['layers'][-1]} refit from "
            f"{len(clients)} client(s); layers refit so far: {len(report['layers'])}", as_json)
