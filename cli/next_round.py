"""What the clients run next: the commands each server-side step of the file-based
protocol prints (docs/calibration.md), so that the protocol runs by copy-paste.

Which round comes next is the library's plan (:func:`fusekit.protocol.plan`, the one the
service, Flower and ``align_locally`` step through): calibration (layer by layer, or in
one pass), an alignment round against the calibrated model, then one refit round per
layer, input to output, starting from the aligned model as ``fusekit align`` wrote it
(each refit folds its layer's BatchNorm into the layer). Here each step finds itself in
that plan and prints the next round as commands.

Commands name files the server knows (the model it wrote, the clients' own models, the
statistics files it was given), ``DATA.npz`` for the data only a client holds and
``CLIENTk`` for client k's own model where the server was not given it; the files the
clients send back go beside the round's model, named after their own models and the round.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from fusekit.protocol import CROSS, REFIT, STATISTICS, Round, plan

DATA = "DATA.npz"  # what only a client knows: its own data file
KINDS = {STATISTICS: "calibration", CROSS: "alignment", REFIT: "refit"}


def numbered(path: Path, index: int) -> Path:
    """``path`` with its stem's trailing ``-<n>`` (if any) replaced by ``-<index>``:
    ``refit.safetensors`` -> ``refit-2.safetensors``, ``refit-2`` -> ``refit-3``."""
    stem = re.sub(r"-\d+$", "", path.stem)
    return path.with_name(f"{stem}-{index}{path.suffix}")


def command(*words: object) -> str:
    return "fusekit " + " ".join(shlex.quote(str(word)) for word in words)


def after_calibration(output: Path, spec, layers: list[str] | None, statistics: list[Path],
                      targets: list[Path], paired: bool) -> dict:
    """After ``fusekit calibrate`` wrote ``output`` with ``layers`` calibrated (None: every
    layer, one pass): the next layer's round, or the alignment round that may follow."""
    rounds = plan(spec, calibration="one-pass" if layers is None else "layerwise",
                  repair=bool(targets), alignment_rounds=1)
    done = 0 if layers is None else max(
        i for i, round_ in enumerate(rounds) if round_.calibrates and round_.layers
        and round_.layers[0] in layers)
    clients = range(len(statistics or targets))
    asked = statistics or [output.with_name(f"CLIENT{k}.stats.safetensors") for k in clients]
    return _announced(rounds, done + 1, output, [Path(f"CLIENT{k}.safetensors") for k in clients],
                      statistics=asked, targets=targets, paired=paired)


def after_alignment(output: Path, spec, clients: list[Path]) -> dict:
    """After ``fusekit align`` wrote ``output``: the first refit round."""
    rounds = plan(spec, alignment_rounds=1)
    return _announced(rounds, [r.kind for r in rounds].index(CROSS) + 1, output, clients)


def after_refit(output: Path, spec, clients: list[Path], layer: str) -> dict:
    """After ``fusekit refit`` wrote ``output`` with ``layer`` refit: the next layer's
    round, or the end of the protocol."""
    rounds = plan(spec, alignment_rounds=1)
    return _announced(rounds, rounds.index(Round(REFIT, layer=layer)) + 1, output, clients)


def _announced(rounds: list[Round], index: int, model: Path, clients: list[Path],
               **calibration) -> dict:
    """Round ``index`` of ``rounds`` (0-based) as what it asks and the commands that run it
    on ``model``; past the last round, the end."""
    if index == len(rounds):
        return {"round": f"nothing: every round is done, {model} is the final model",
                "clients": [], "then": None}
    round_ = rounds[index]
    alike = [r for r in rounds if r.kind == round_.kind]
    number = alike.index(round_) + 1
    where = f"{KINDS[round_.kind]} round {number} of {len(alike)}"
    if round_.kind == CROSS:
        return _alignment_round(model, clients, where)
    if round_.kind == REFIT:
        return _refit_round(model, clients, round_.layer, where, number)
    return _calibration_round(model, round_.layers[0], where, number, **calibration)


def _calibration_round(model: Path, layer: str, where: str, number: int,
                       statistics: list[Path], targets: list[Path], paired: bool) -> dict:
    repeated = [word for path in targets for word in ("--targets", path)]
    return {"round": f"{where} calibrates layer {layer!r} of {model}",
            "clients": [command("stats", model, "--data-path", DATA, "-o", path, "--force")
                        for path in statistics],
            "then": command("calibrate", model, *statistics, *repeated,
                            *(["--paired"] if paired else []), "--layers", layer, "-o",
                            numbered(model, number))}


def _alignment_round(model: Path, clients: list[Path], where: str) -> dict:
    cross = [model.with_name(f"{own.stem}.cross{own.suffix}") for own in clients]
    return {"round": f"{model} is calibrated; {where}, for clients from independent "
                     "initialisations, re-matches them to it (docs/calibration.md, "
                     "\"Alignment rounds\")",
            "clients": [command("stats", model, "--against", own, "--data-path", DATA,
                                "-o", reply)
                        for own, reply in zip(clients, cross, strict=True)],
            "then": command("align", model, *clients,
                            *(word for reply in cross for word in ("--cross-stats", reply)),
                            "-o", model.with_name(f"aligned{model.suffix}"))}


def _refit_round(model: Path, clients: list[Path], layer: str, where: str,
                 number: int) -> dict:
    replies = [model.with_name(f"{own.stem}.refit-{number}{own.suffix}") for own in clients]
    start = ("the aligned model as written, not calibrated: each refit folds its layer's "
             "BatchNorm" if number == 1 else "the model the last refit wrote")
    return {"round": f"{where} refits layer {layer!r} of {model} (it starts from {start})",
            "clients": [command("stats", model, "--against", own, "--layer", layer,
                                "--data-path", DATA, "-o", reply)
                        for own, reply in zip(clients, replies, strict=True)],
            "then": command("refit", model, *clients,
                            *(word for reply in replies for word in ("--refit-stats", reply)),
                            "-o", model.with_name(f"refit-{number}{model.suffix}"))}


def lines(step: dict) -> list[str]:
    """The step as printed: what comes next, the clients' commands, the server's."""
    out = [f"next: {step['round']}"]
    if step["clients"]:
        out[0] += ". The clients run, each its line on its own data:"
        out += [f"  {line}" for line in step["clients"]]
    if step["then"]:
        out += ["then here:", f"  {step['then']}"]
    return out
