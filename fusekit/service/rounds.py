"""Calibration protocols of a job, as rounds (ALGORITHMS §12): what each round asks the
clients for, how an upload is checked against the round, and what the worker computes
from a round's files.

A job that calibrates has, once fused, a plan (a list of steps) and a current round
(``job["round"]``): its index, what it asks for (``kind``: statistics of the round's model
in a mode, for some layers; cross statistics of the round's model and the client's own;
refit statistics of one layer; or nothing new, ``derived``: the first layer from the input
moments the targets carry), the model the clients run (content hash, SHA-256, file) and
what an upload must match. Each round, every participating client downloads the round's
model and uploads one file into its statistics slot; the worker computes the next round's
model from them (:func:`advance`, in a process of its own) and the slots start empty again.

Protocols:

- ``one-pass``: one round of ``batch``-mode statistics (``eval`` for a transformer).
- ``layerwise``: one round of ``eval``-mode statistics per calibrated layer, input to
  output (exact); with ``input_moments`` the first layer is derived from the targets'
  input moments without a round.
- ``align``: a one-pass calibration round, an alignment round (cross statistics against
  the calibrated model), then one refit round per layer, input to output.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from fusekit.core import metadata as meta
from fusekit.core.checkpoint import load_checkpoint
from fusekit.core.cross_stats import load_cross_statistics, load_refit_statistics
from fusekit.core.errors import ParameterError, StatisticsError
from fusekit.core.model_spec import client_spec, fused_spec, model_points
from fusekit.core.stats import BN_INPUT, load_statistics
from fusekit.core.transformer import TransformerSpec
from fusekit.methods.alignment import cross_points, layer_inputs
from fusekit.protocol import (
    CROSS,
    DERIVED,
    REFIT,
    REPORTS,
    STATISTICS,
    Round,
    start,
)
from fusekit.protocol import advance as step
from fusekit.protocol import plan as protocol_plan
from fusekit.service.errors import Conflict

PROTOCOLS = ("one-pass", "layerwise", "align")
_HEADER_BYTES = 4096  # a statistics file's header beyond its per-point entries
_POINT_BYTES = 768  # a header entry naming up to six tensors of a point


def plan(protocol: str, model: Path, *, input_moments: bool) -> list[dict[str, Any]]:
    """The rounds of ``protocol`` for the fused model at ``model`` (:func:`fusekit.protocol.plan`:
    ``one-pass`` and ``layerwise`` calibrate; ``align`` calibrates in one pass, then runs
    an alignment round and the refit rounds), as the job records them."""
    checkpoint = load_checkpoint(model)
    spec = fused_spec(checkpoint)
    if protocol != "one-pass" and isinstance(spec, TransformerSpec):
        raise ParameterError(f"protocol {protocol!r}: a transformer job calibrates in one "
                             "pass (protocol one-pass)")
    rounds = protocol_plan(spec, calibration="layerwise" if protocol == "layerwise"
                           else "one-pass", repair=needs_targets(checkpoint, spec),
                           derive_first=input_moments,
                           alignment_rounds=1 if protocol == "align" else 0)
    if not rounds or not rounds[0].calibrates:
        raise ParameterError(f"protocol {protocol!r}: the fused model has no hidden layer to "
                             f"calibrate ({len(spec.layers)} layer(s))")
    return [r.as_dict() for r in rounds]


def needs_targets(checkpoint, spec) -> bool:
    """Whether calibration of this model is REPAIR's (no BatchNorm to restore: a plain MLP,
    a transformer), which needs the clients' statistics of their own models."""
    return isinstance(spec, TransformerSpec) or not any(
        point.startswith(f"{BN_INPUT}:") for point in model_points(checkpoint, spec))


def describe(step: dict[str, Any], index: int, total: int, model: Path, file: str,
             clients: list[Path], spec_json: dict[str, Any] | None, participants: list[str]
             ) -> dict[str, Any]:
    """The round record of ``step`` (the ``index``-th of ``total``) run on ``model`` (stored
    as ``file`` in the job's folder; ``clients``: the clients' checkpoints, ``spec_json``
    the job's spec): what it asks for, what an upload must match, its size limit (``max_bytes``:
    what the largest honest file takes), and who takes part."""
    checkpoint = load_checkpoint(model)
    spec = fused_spec(checkpoint)
    record = {**step, "index": index, "total": total, "model": checkpoint.content_hash,
              "file": file, **file_record(model), "participants": participants}
    if step["kind"] == STATISTICS:
        points = model_points(checkpoint, spec)
        record.update(points=points, max_bytes=statistics_bytes(points))
    elif step["kind"] == CROSS:
        widths, widest = cross_points(spec), _widest(clients, spec_json)
        record.update(widths=widths, max_bytes=_HEADER_BYTES + sum(
            8 * (r + 2) * (widest.get(p, r) + 2) + _POINT_BYTES for p, r in widths.items()))
    elif step["kind"] == REFIT:
        d = layer_inputs(spec)[step["layer"]]
        out = _widest(clients, spec_json).get(step["layer"], 0)
        record.update(inputs=layer_inputs(spec),
                      max_bytes=8 * (d + 1) * (d + 1 + out) + _HEADER_BYTES)
    else:
        record.update(max_bytes=0)
    return record


def statistics_bytes(points: dict[str, int], inputs: dict[str, int] | None = None) -> int:
    """The largest honest statistics file of these points (and input moments, each of
    dimension d): float64 count, mean and variance per channel, count, mean and (d, d)
    covariance per input point, and their header."""
    moments = sum(8 * (1 + d + d * d) for d in (inputs or {}).values())
    return (24 * sum(points.values()) + moments
            + _POINT_BYTES * (len(points) + len(inputs or {})) + _HEADER_BYTES)


def file_record(path: Path) -> dict[str, Any]:
    """A model file's SHA-256 and size, as the job shows them."""
    with open(path, "rb") as f:
        return {"sha256": hashlib.file_digest(f, "sha256").hexdigest(),
                "size": path.stat().st_size}


def _widest(clients: list[Path], spec_json: dict[str, Any] | None) -> dict[str, int]:
    """Per layer name and cross-statistics point, the widest client's width there."""
    widest: dict[str, int] = {}
    for path in clients:
        spec = client_spec(load_checkpoint(path), spec_json)
        for point, width in {**{layer.name: layer.out_features for layer in spec.layers},
                             **cross_points(spec)}.items():
            widest[point] = max(widest.get(point, 0), width)
    return widest


def what_it_asks(round_: dict[str, Any]) -> str:
    """One line: what a round asks each client for."""
    where = f"round {round_['index']} of {round_['total']}"
    if round_["kind"] == DERIVED:
        return (f"{where}: nothing new (layer {round_['layers'][0]!r} from the input moments "
                "the targets carry)")
    if round_["kind"] == CROSS:
        return f"{where}: cross statistics of the round's model and your own (alignment)"
    if round_["kind"] == REFIT:
        return f"{where}: refit statistics of layer {round_['layer']!r}"
    layers = "every layer" if round_["layers"] is None else f"layer {round_['layers'][0]!r}"
    return f"{where}: statistics of the round's model ({round_['mode']} mode, {layers})"


# -- checking an upload (in a checker process) -----------------------------------------------

def check_upload(part: Path, label: str, round_: dict[str, Any], own: Path | None,
                 spec: dict[str, Any] | None, min_samples: int,
                 earlier: dict[str, int]) -> None:
    """The upload ``part`` as the round's worker will read it: a file of the round's kind,
    of the round's model (and of the client's own checkpoint at ``own``), its layers and
    widths, over at least ``min_samples`` inputs. A file of an earlier round's model
    (``earlier``: content hash -> round) is refused as stale, in one line."""
    _check_not_stale(part, label, round_, earlier)
    kind = round_["kind"]
    named = f"{'statistics' if kind == STATISTICS else kind + ' statistics'} of {label}"
    try:
        if kind == STATISTICS:
            stats = load_statistics(part, model=round_["model"], points=round_["points"],
                                    min_samples=min_samples, inputs={})
            if stats.mode != round_["mode"]:
                raise StatisticsError(
                    f"{part}: computed in {stats.mode} mode; {what_it_asks(round_)} "
                    f"(fusekit stats MODEL --mode {round_['mode']} ...)")
        elif kind == CROSS:
            checkpoint = load_checkpoint(own)
            load_cross_statistics(part, reference=round_["model"], widths=round_["widths"],
                                  models={checkpoint.content_hash: cross_points(
                                      client_spec(checkpoint, spec))},
                                  min_samples=min_samples)
        else:
            checkpoint = load_checkpoint(own)
            layers = client_spec(checkpoint, spec).layers
            stats = load_refit_statistics(
                part, reference=round_["model"], inputs=round_["inputs"],
                models={checkpoint.content_hash: {x.name: x.out_features for x in layers}},
                min_samples=min_samples)
            if stats.layer != round_["layer"]:
                raise StatisticsError(f"{part}: refit statistics of layer {stats.layer!r}; "
                                      f"{what_it_asks(round_)}")
    except StatisticsError as exc:
        raise StatisticsError(_named(str(exc), part, named)) from None


def _named(text: str, part: Path, named: str) -> str:
    for kind in ("statistics file", "cross statistics file", "refit statistics file"):
        text = text.replace(f"{kind} {part}", named)
    return text.replace(str(part), named)


def _check_not_stale(part: Path, label: str, round_: dict[str, Any],
                     earlier: dict[str, int]) -> None:
    try:
        metadata = load_checkpoint(part).metadata
    except Exception:  # an unreadable file: the full check names what is wrong
        return
    for key, field in ((meta.STATS, "model"), (meta.CROSS_STATS, "reference"),
                       (meta.REFIT_STATS, "reference")):
        try:
            model = json.loads(metadata.get(key, "{}")).get(field)
        except (ValueError, AttributeError):
            continue
        if model in earlier and model != round_["model"]:
            raise Conflict(stale(label, earlier[model], round_))


def stale(label: str, index: int, round_: dict[str, Any]) -> str:
    """Why an upload for another round than the current one is refused."""
    when = "which is over" if index < round_["index"] else "which has not started"
    return (f"{label}: statistics for round {index}, {when}; the job is in "
            f"{what_it_asks(round_)}: download the round's model (fusekit fetch) and compute "
            "them again (fusekit contribute does both)")


# -- what the worker computes (in a process of its own) -----------------------------------

def advance(round_: dict[str, Any], model: str, statistics: dict[str, str],
            targets: dict[str, str], clients: dict[str, str], min_samples: int,
            output: str) -> str:
    """One round's step (:func:`fusekit.protocol.advance`) from its files, by client:
    the statistics received, the targets, the participants' checkpoints. Writes the next
    model to ``output``; returns the step's report and who takes part next (JSON)."""
    state = step(start(model, [Round.from_dict(round_)], clients, targets=targets,
                       min_samples=min_samples), statistics)
    state.result.save(output, force=True)
    key = REPORTS[round_["kind"]]
    return json.dumps({key: state.result.report[key], "participants": state.participants},
                      default=jsonable)


def jsonable(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else str(value)
