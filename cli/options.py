"""Options shared by several commands, declared once so they read the same everywhere."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

JsonOption = Annotated[
    bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")
]
DATA_CHOICES = "digits (embedded), mnist, fashion-mnist, cifar10, npz or synthetic"
DATA_DEFAULT = "(default: npz with --data-path, else digits)"  # toolkit.data.dataset_name
DataOption = Annotated[
    str | None,
    typer.Option("--data", help=f"{DATA_CHOICES} {DATA_DEFAULT}.", show_default=False),
]
DataDirOption = Annotated[
    Path | None,
    typer.Option("--data-dir", help="Folder with the mnist/fashion-mnist/cifar10 files."),
]
DataPathOption = Annotated[Path | None, typer.Option("--data-path", help="The .npz file for npz.")]
SamplesOption = Annotated[int, typer.Option("--samples", help="synthetic: number of samples.")]
FeaturesOption = Annotated[int, typer.Option("--features", help="synthetic: input dimension.")]
ClassesOption = Annotated[int, typer.Option("--classes", help="synthetic: number of classes.")]
DataSeedOption = Annotated[int, typer.Option("--seed", help="synthetic: the data seed.")]
DeviceOption = Annotated[
    str, typer.Option("--device", help="auto (cuda when available), cpu or cuda.")
]

NormalizeOption = Annotated[list[str] | None, typer.Option(
    "--normalize", metavar="MEAN,STD",
    help="The input normalisation a model expects: it sees (x - MEAN) / STD of the data as "
    "stored. Repeat once per input channel, in order (one pair: every value). For models "
    "that record none (fusekit.preprocess); one recording another is refused. simulate: "
    "what the clients train with and record.", show_default=False)]


def normalization_option(values: list[str] | None):
    """``--normalize`` as a :class:`~fusekit.core.metadata.Normalization` (None: not given).

    Raises:
        ParameterError: a value that is not two numbers ``MEAN,STD`` with STD > 0.
    """
    from fusekit.core.errors import ParameterError
    from fusekit.core.metadata import normalization

    if not values:
        return None
    pairs = []
    for value in values:
        try:
            mean, std = (float(part) for part in value.split(","))
            pairs.append((mean, std))
        except ValueError:
            raise ParameterError(f"--normalize: expected MEAN,STD (two numbers), found "
                                 f"{value!r}") from None
    try:
        return normalization([m for m, _ in pairs], [s for _, s in pairs])
    except ValueError as exc:
        raise ParameterError(f"--normalize: {exc}; found {' '.join(values)!r}") from None


def dataset_option(data: str | None, data_dir: Path | None, data_path: Path | None,
                   samples: int, features: int, classes: int, seed: int):
    """The data set the ``--data`` options name (toolkit.data: torch, so imported only by
    the commands that run models)."""
    from fusekit.toolkit.data import load_dataset

    return load_dataset(data, data_dir=data_dir, path=data_path, samples=samples,
                        features=features, classes=classes, seed=seed)


def described(path: Path, normalization):
    """The model at ``path`` as ``--normalize`` describes it: its checkpoint recording that
    preprocessing (the file untouched), or ``path`` itself without ``--normalize``.

    Raises:
        ParameterError: the model records another preprocessing.
    """
    if normalization is None:
        return path
    from fusekit.core.checkpoint import load_checkpoint, with_preprocess

    return with_preprocess(load_checkpoint(path), normalization)


# How `fusekit demo` and `fusekit simulate --rounds` calibrate a fused model with the
# clients' statistics of their own data (the forward passes run locally, ALGORITHMS §12).
CalibrateOption = Annotated[bool, typer.Option(
    "--calibrate", help="Calibrate each fused model with the clients' statistics of their "
    "own data (fusekit stats / calibrate, layer by layer) and show its accuracy.")]
AlignOption = Annotated[bool, typer.Option(
    "--align", help="Calibrate each fused model, run one alignment round and a refit round "
    "per layer with the clients' statistics of their own data (fusekit stats --against / "
    "align / refit; what fuses independently initialised clients) and show its accuracy.")]


def _plain_help(params):
    """No type placeholders in --help: flags show none, arguments only their name."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
        elif param.param_type_name == "argument":
            param.display_type_rich = types.MethodType(lambda _self, ctx: None, param)
    return params


class Command(TyperCommand):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.short_help is None and self.help:
            # The command list shows the docstring's first paragraph as one line: its line
            # breaks would break the list's lines mid-sentence.
            self.short_help = " ".join(self.help.split("\n\n")[0].split())

    def get_params(self, ctx):
        return _plain_help(super().get_params(ctx))


class Group(TyperGroup):
    def get_params(self, ctx):
        return _plain_help(super().get_params(ctx))
