"""What the clients run next: the commands each server-side step of the file-based
protocol prints (docs/calibration.md), so that the protocol runs by copy-paste.

The order of rounds is the library's (``fusekit.toolkit.alignment.align_locally``):
calibration (layer by layer, or in one pass), an alignment round against the calibrated
model, then one refit round per layer, input to output, starting from the aligned model as
``fusekit align`` wrote it: each refit folds its layer's BatchNorm into the layer, so the
aligned model is not calibrated in between.

Commands name files the server knows (the model it wrote, the clients' own models, the
statistics files it was given) and ``DATA.npz`` for the data only a client holds.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

DATA = "DATA.npz"  # what only a client knows: its own data file


def numbered(path: Path, index: int) -> Path:
    """``path`` with its stem's trailing ``-<n>`` (if any) replaced by ``-<index>``:
    ``refit.safetensors`` -> ``refit-2.safetensors``, ``refit-2`` -> ``refit-3``."""
    stem = re.sub(r"-\d+$", "", path.stem)
    return path.with_name(f"{stem}-{index}{path.suffix}")


def command(*words: object) -> str:
    return "fusekit " + " ".join(shlex.quote(str(word)) for word in words)


def after_calibration(output: Path, calibrated: list[str], order: list[str],
                      statistics: list[Path], targets: list[Path], paired: bool) -> dict:
    """After ``fusekit calibrate`` wrote ``output`` with the layers ``calibrated`` (of the
    model's calibration ``order``, input to output): the next layer's round, or, once the
    last layer is calibrated, the alignment round that may follow."""
    last = max(order.index(name) for name in calibrated)
    if last + 1 == len(order):  # the alignment round, its clients' files named by index
        own = [Path(f"CLIENT{k}.safetensors") for k in range(len(statistics or targets))]
        cross = [path.with_suffix(".cross.safetensors") for path in own]
        return {"round": f"{output} is calibrated. Optional, for clients from independent "
                         "initialisations: an alignment round (docs/calibration.md, "
                         "\"Alignment rounds\"; CLIENTk: client k's own model)",
                "clients": [command("stats", output, "--against", model, "--data-path", DATA,
                                    "-o", reply, "--force")
                            for model, reply in zip(own, cross, strict=True)],
                "then": command("align", output, *own,
                                *(word for reply in cross for word in ("--cross-stats", reply)),
                                "-o", output.with_name(f"aligned{output.suffix}"))}
    layer, index = order[last + 1], last + 2
    repeated = [word for path in targets for word in ("--targets", path)]
    named = "" if statistics else " (CLIENTk: client k)"
    statistics = statistics or [Path(f"CLIENT{k}.stats.safetensors") for k in range(len(targets))]
    return {"round": f"calibration round {index} of {len(order)} calibrates layer {layer!r} "
                     f"of {output}{named}",
            "clients": [command("stats", output, "--data-path", DATA, "-o", path, "--force")
                        for path in statistics],
            "then": command("calibrate", output, *statistics, *repeated,
                            *(["--paired"] if paired else []), "--layers", layer, "-o",
                            numbered(output, index))}


def after_alignment(output: Path, clients: list[Path], layers: list[str]) -> dict:
    """After ``fusekit align`` wrote ``output``: the first refit round."""
    return _refit_round(output, clients, layers, 0)


def after_refit(output: Path, clients: list[Path], layers: list[str], last: str) -> dict:
    """After ``fusekit refit`` wrote ``output`` with layer ``last`` refit: the next layer's
    refit round, or the end of the protocol."""
    index = layers.index(last) + 1
    if index == len(layers):
        return {"round": f"nothing: every layer is refit, {output} is the final model",
                "clients": [], "then": None}
    return _refit_round(output, clients, layers, index)


def _refit_round(model: Path, clients: list[Path], layers: list[str], index: int) -> dict:
    layer = layers[index]
    replies = [own.with_name(f"{own.stem}.refit-{index + 1}{own.suffix}") for own in clients]
    start = ("the aligned model as written, not calibrated: each refit folds its layer's "
             "BatchNorm" if index == 0 else "the model the last refit wrote")
    return {"round": f"refit round {index + 1} of {len(layers)} refits layer {layer!r} of "
                     f"{model} (it starts from {start})",
            "clients": [command("stats", model, "--against", own, "--layer", layer,
                                "--data-path", DATA, "-o", reply)
                        for own, reply in zip(clients, replies, strict=True)],
            "then": command("refit", model, *clients,
                            *(word for reply in replies for word in ("--refit-stats", reply)),
                            "-o", model.with_name(f"refit-{index + 1}{model.suffix}"))}


def lines(step: dict) -> list[str]:
    """The step as printed: what comes next, the clients' commands, the server's."""
    out = [f"next: {step['round']}"]
    if step["clients"]:
        out[0] += ". The clients run, each its line on its own data:"
        out += [f"  {line}" for line in step["clients"]]
    if step["then"]:
        out += ["then here:", f"  {step['then']}"]
    return out
