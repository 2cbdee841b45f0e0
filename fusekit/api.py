"""``fusekit.fuse``: the one call behind the CLI, the Python API and every other front door."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fusekit.core import metadata as meta
from fusekit.core.checkpoint import (
    HASH_THREADS,
    Checkpoint,
    common_preprocess,
    load_checkpoint,
)
from fusekit.core.errors import CheckpointError, IncompatibleModelsError, ParameterError
from fusekit.core.metadata import load_json
from fusekit.core.model_spec import SpecLike, check_compatible, client_spec, client_specs
from fusekit.core.spec import (
    GraphSpec,
    PermutationSpec,
    spec_from_json,
)
from fusekit.core.transformer import TransformerSpec
from fusekit.methods import METHODS, calibration, get_method
from fusekit.methods.base import FusionMethod, FusionResult, provenance, sample_weights
from fusekit.methods.params import ParamSpec, method_params, validate

log = logging.getLogger(__name__)

CheckpointLike = str | os.PathLike[str] | Checkpoint


def fuse(
    inputs: Sequence[CheckpointLike],
    method: str = "avg",
    *,
    spec: SpecLike | None = None,
    **params: Any,
) -> FusionResult:
    """Fuse client checkpoints into one model, in one shot and without data.

    Args:
        inputs: safetensors paths or :class:`Checkpoint` objects, one per client. Their
            order does not matter: clients are put in a canonical order (widest first,
            then by a hash of their contents, see :func:`canonical_order`) so a fusion is
            reproducible on any machine.
        method: a name from ``fusekit.METHODS`` (avg, pfnm, nafi, ot, ams, ...).
        spec: a JSON spec file, its parsed dict, or a PermutationSpec, for models whose
            permutation structure cannot be inferred from names and shapes.
        **params: the method's parameters (docs/PARAMETERS.md, ``fusekit fuse --help``),
            checked against the method's declaration: strict types (an int parameter
            refuses 3.5 and "3"; a float one accepts 3), choices and bounds.

    Returns:
        FusionResult with the fused state_dict, widths, report and provenance metadata.

    Raises:
        CheckpointError: an input is missing, corrupt or holds unusable tensors.
        IncompatibleModelsError: the inputs do not describe the same kind of network.
        UnknownMethodError, ParameterError: bad method name or parameters.
    """
    if isinstance(inputs, (str, os.PathLike, Checkpoint)):
        raise ParameterError(
            f"inputs: expected a list of checkpoints, found one {type(inputs).__name__} "
            f"({inputs!r:.80}); pass [path] to fuse a single file"
        )
    if not inputs:
        raise ParameterError("inputs: expected at least one checkpoint, got none")
    fusion, declared = validate_params(method, params)
    checkpoints = [c if isinstance(c, Checkpoint) else load_checkpoint(c) for c in inputs]
    if len(inputs) == 1:  # once the input is known to be a checkpoint
        log.warning("fusing a single checkpoint with %s: there is nothing to combine; the "
                    "result is that client's model", fusion.name)
    common_preprocess(checkpoints)
    specs = client_specs(checkpoints, spec)
    if fusion.requires_same_architecture:
        check_compatible(checkpoints, specs)
    transformers = [c for c, s in zip(checkpoints, specs, strict=True)
                    if isinstance(s, TransformerSpec)]
    if transformers and not fusion.handles_transformers:
        fusing = [name for name, cls in sorted(METHODS.items()) if cls.handles_transformers]
        raise IncompatibleModelsError(
            f"{transformers[0].label}: a transformer; method {method!r} does not fuse "
            f"transformers; use one of {', '.join(fusing)}"
        )
    if not fusion.handles_groups and any(isinstance(s, GraphSpec) for s in specs):
        fusing = [name for name, cls in sorted(METHODS.items()) if cls.handles_groups]
        raise IncompatibleModelsError(
            f"{checkpoints[0].label}: a residual network (permutation groups shared by several "
            f"layers); method {method!r} fuses sequential networks only; use one of "
            f"{', '.join(fusing)}"
        )
    order = canonical_order(checkpoints, specs)
    checkpoints = [checkpoints[i] for i in order]
    specs = [specs[i] for i in order]
    per_client = [p.name for p in declared if p.per_client]
    params = _in_canonical_order(params, per_client, order)
    with _content_hashes_meanwhile([] if fusion.hashes_inputs else checkpoints):
        start = time.perf_counter()
        with _peak_memory() as peak:
            result = fusion.fuse(checkpoints, specs, **params)
        elapsed = time.perf_counter() - start
    result.report.setdefault("time_s", elapsed)
    result.report.setdefault("peak_memory_mb", peak["mb"])
    result.report.setdefault("clients", [c.label for c in checkpoints])
    provenance(result, checkpoints)
    _calibration_metadata(result, fusion, checkpoints, specs)
    for checkpoint in checkpoints:  # the result holds its own arrays: the inputs' can go
        checkpoint.release()
    return result


def _calibration_metadata(result: FusionResult, fusion: FusionMethod,
                          checkpoints: Sequence[Checkpoint], specs: Sequence[PermutationSpec]
                          ) -> None:
    """What calibration needs from the fusion (ALGORITHMS §12): the fused neuron of every
    client neuron and, where the method folded BatchNorms, the matched clients' affine."""
    if result.assignments is None:
        return
    result.metadata[meta.ASSIGNMENTS] = calibration.assignments_json(result.assignments)
    if fusion.folds_batchnorm and not isinstance(specs[0], TransformerSpec) and any(
            layer.norm for layer in specs[0].layers):
        targets = calibration.norm_targets(checkpoints, specs, result.spec, result.assignments,
                                           sample_weights(checkpoints))
        result.metadata[meta.NORM_TARGETS] = json.dumps(targets, separators=(",", ":"))


@contextlib.contextmanager
def _content_hashes_meanwhile(checkpoints: Sequence[Checkpoint]) -> Iterator[None]:
    """Compute the inputs' content hashes, which the provenance records, on
    ``HASH_THREADS`` more threads while the block (the fusion) runs: sha256 and file reads
    release the GIL, and so do the engine's kernels. If the block fails, its error is
    raised and hashes not begun are dropped; otherwise the first hashing error, in
    canonical order, is."""
    pool = ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="fusekit-hash")
    futures = [pool.submit(lambda c=c: c.content_hash) for c in checkpoints]
    try:
        yield
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    for future in futures:
        future.result()


@contextlib.contextmanager
def _peak_memory():
    """Peak resident memory of the process during the block, in MB, or None off Linux.

    Linux keeps the high-water mark (VmHWM) and lets a process reset it through
    /proc/self/clear_refs: two small file operations, against the 25 % that tracing every
    allocation (tracemalloc) adds to a fusion. It is the whole process's resident peak
    (the interpreter and what was loaded before included), the C++ engine's buffers too.
    """
    out: dict[str, float | None] = {"mb": None}
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        yield out
        return
    yield out
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                out["mb"] = round(int(line.split()[1]) / 1024, 1)


def validate_params(method: str, params: Mapping[str, Any]
                    ) -> tuple[FusionMethod, list[ParamSpec]]:
    """The method and its declared parameters, once ``params`` passed that declaration:
    what :func:`fuse` checks before reading any checkpoint (front doors call it to refuse a
    request early).

    Raises:
        UnknownMethodError, ParameterError: bad method name or parameters.
    """
    fusion = get_method(method)
    declared = method_params(fusion)
    validate(fusion.name, declared, dict(params))
    return fusion, declared


def fusion_summary(result: FusionResult, output: str, time_s: float) -> dict[str, Any]:
    """The report of one fusion: what ``fusekit fuse --json`` prints and the service serves."""
    return {
        "output": output,
        "method": result.method,
        "params": result.params,
        "widths": result.widths,
        "time_s": time_s,
        "report": result.report,
    }


def _in_canonical_order(params: dict[str, Any], names: Sequence[str],
                        order: Sequence[int]) -> dict[str, Any]:
    """Per-client values come in the order of the inputs; methods see clients reordered."""
    out = dict(params)
    for name in names:
        value = out.get(name)
        if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == len(order):
            out[name] = type(value)(value[i] for i in order) if isinstance(value, tuple) else [
                value[i] for i in order]
    return out


def canonical_order(checkpoints: Sequence[Checkpoint],
                    specs: Sequence[PermutationSpec]) -> list[int]:
    """Indices of the clients in canonical order, a function of their contents alone
    (independent of input order): widest first, then by sample hash, then, among clients
    whose widths and sample hash are equal, by content hash. Only those clients are
    hashed in full here; the others' content hashes are left for the provenance."""
    keys = [(tuple(-w for w in spec.hidden_widths), checkpoint.sample_hash)
            for checkpoint, spec in zip(checkpoints, specs, strict=True)]
    shared = {key for key, n in Counter(keys).items() if n > 1}
    return sorted(range(len(checkpoints)), key=lambda i: (
        *keys[i], checkpoints[i].content_hash if keys[i] in shared else ""))


def describe_checkpoint(checkpoint: Checkpoint) -> dict[str, Any]:
    """What ``fusekit inspect`` shows: layers, widths, permutation groups, metadata, problems."""
    info: dict[str, Any] = {
        "path": checkpoint.label,
        "tensors": len(checkpoint.tensors),
        "parameters": sum(math.prod(t.shape) for t in checkpoint.tensors.values()),
        "metadata": checkpoint.metadata,
        "problems": [],
    }
    try:
        if meta.AMS in checkpoint.metadata:
            return _describe_ams(checkpoint, info)
        spec = client_spec(checkpoint, None)
    except ValueError as exc:
        info["problems"].append(str(exc))
        return info
    if isinstance(spec, TransformerSpec):
        info["family"] = spec.family
        info["groups"] = spec.describe()
        members = [group.slots for group in spec.groups]
    else:
        info["layers"] = spec.describe()
        members = [spec.group(i) for i in range(len(spec.hidden_widths))]
    info["hidden_widths"] = spec.hidden_widths
    info["group_names"] = list(spec.group_names)
    info["permutation_groups"] = [[_axis_text(a) for a in group] for group in members]
    info["other_tensors"] = list(spec.other)
    info["limits"] = _permutation_limits(checkpoint, spec)
    try:
        checkpoint.check_values()
    except ValueError as exc:
        info["problems"].append(str(exc))
    info["metadata"] = {k: _maybe_json(v) for k, v in checkpoint.metadata.items()}
    return info


def _axis_text(ref: Any) -> str:
    """``tensor[axis A, block B, from O]``: one member of a permutation group."""
    extras = [f", block {ref.block}" if ref.block > 1 else "",
              f", from {ref.offset}" if getattr(ref, "offset", 0) else ""]
    return f"{ref.tensor}[axis {ref.axis}{''.join(extras)}]"


def _describe_ams(checkpoint: Checkpoint, info: dict[str, Any]) -> dict[str, Any]:
    """An AMS artefact: its selection rule and each sub-model's layers, from its metadata."""
    from fusekit.methods.ams import read_ams_metadata

    description = read_ams_metadata(checkpoint.metadata, checkpoint.label)
    shapes = {name: t.shape for name, t in checkpoint.tensors.items()}
    models = []
    for entry in description["models"]:
        prefix = entry["prefix"]
        own = {n[len(prefix):]: s for n, s in shapes.items() if n.startswith(prefix)}
        spec = spec_from_json(entry["spec"], own, label=f"{checkpoint.label} [{prefix}*]")
        models.append({"prefix": prefix, "layers": spec.describe(),
                       "hidden_widths": spec.hidden_widths})
    info.update(ams={"mode": description["mode"], "k": description["k"], "models": models},
                hidden_widths=[m["hidden_widths"] for m in models],
                metadata={k: _maybe_json(v) for k, v in checkpoint.metadata.items()})
    return info


def _permutation_limits(checkpoint: Checkpoint, spec: PermutationSpec) -> list[str]:
    """Why permutation-based methods would refuse this checkpoint (other methods may not)."""
    from fusekit.core.neurons import refuse_position_aware
    from fusekit.methods import METHODS

    permuting = sorted(name for name, cls in METHODS.items() if cls.permutes_neurons)
    try:
        refuse_position_aware([checkpoint], [spec], "/".join(permuting))
    except IncompatibleModelsError as exc:
        return [str(exc)]
    return []


def _maybe_json(value: str) -> Any:
    try:
        return load_json(value, "metadata")
    except CheckpointError:
        return value
