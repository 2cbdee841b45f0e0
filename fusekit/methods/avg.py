"""Coordinate averaging (FedAvg), ALGORITHMS.md §1."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Annotated, Any

import numpy as np

from fusekit.core import progress
from fusekit.core.checkpoint import (
    HASH_THREADS,
    MAP_MIN_BYTES,
    VARIANCE_SUFFIXES,
    Checkpoint,
    count_non_finite,
    is_integer_buffer,
)
from fusekit.core.errors import IncompatibleModelsError, ParameterError
from fusekit.core.metadata import CLASS_COUNTS
from fusekit.core.spec import PermutationSpec
from fusekit.core.transformer import TransformerSpec
from fusekit.methods.base import FusionMethod, FusionResult, register, sample_weights
from fusekit.methods.params import Param

#: Bytes of one client's tensor averaged at a time: mapped from its file, or read into a
#: reused buffer per client when smaller than ``MAP_MIN_BYTES``.
PIECE_BYTES = 4 << 20
#: Values summed at a time: the float64 sum and product stay in the CPU's cache.
SUM_BLOCK = 1 << 15
#: Bytes of a round of pieces (all clients) hashed on the calling thread: handing fewer to
#: the hashing threads costs more than it saves.
SMALL_HASH_BYTES = 1 << 18


@register
class Average(FusionMethod):
    name = "avg"
    summary = "coordinate averaging weighted by sample counts (FedAvg)"
    handles_groups = True
    handles_transformers = True
    hashes_inputs = True

    def fuse(
        self,
        checkpoints: Sequence[Checkpoint],
        specs: Sequence[PermutationSpec],
        *,
        class_weighted: Annotated[bool, Param(
            help="average output rows with per-class sample shares (needs fusekit.class_counts)",
            paper="NAFI Algorithm 2, line 7",
        )] = False,
    ) -> FusionResult:
        """θ = Σ_s α_s θ_s with α_s = N_s / Σ N.

        BatchNorm running statistics are averaged like weights; integer counters
        (``num_batches_tracked``) take the maximum. With ``class_weighted``, row k of the
        output layer and its bias are averaged with weights N_sk / Σ_s N_sk (NAFI
        Algorithm 2, line 7), which needs ``fusekit.class_counts`` in every checkpoint.

        Raises:
            IncompatibleModelsError: a tensor's shape differs between clients.
            ParameterError: ``class_weighted`` without class counts.
        """
        check_equal_shapes(checkpoints)
        weights = sample_weights(checkpoints)
        buffers = [np.empty(min(PIECE_BYTES, MAP_MIN_BYTES), dtype=np.uint8)
                   for _ in checkpoints]
        names = checkpoints[0].tensors
        fused: dict[str, np.ndarray] = dict.fromkeys(names)  # type: ignore[arg-type]
        with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="fusekit-hash") as pool:
            hashes = InputHashes(checkpoints, pool)
            for done, name in enumerate(sorted(names), 1):  # the content hashes' order
                fused[name] = average_from_files(checkpoints, name, weights, buffers, hashes)
                progress.advance("tensors averaged", done, len(names))
            hashes.finish()
        if class_weighted:
            if isinstance(specs[0], TransformerSpec):
                raise ParameterError("class_weighted: averages a sequential network's output "
                                     "rows; not available for transformers")
            head = specs[0].layers[-1]
            shares = class_shares(checkpoints, head.out_features)
            for name in filter(None, (head.weight, head.bias)):
                stacked = np.stack([c.tensor(name) for c in checkpoints]).astype(np.float64)
                rows = np.einsum("sk,sk...->k...", shares, stacked)
                fused[name] = rows.astype(checkpoints[0].tensor(name).dtype)
        identity = [np.arange(width) for width in specs[0].hidden_widths]
        return self.result(fused, checkpoints, specs[0], {"class_weighted": class_weighted},
                           assignments=[identity] * len(checkpoints))


def average_from_files(checkpoints: Sequence[Checkpoint], name: str, weights: np.ndarray,
                       buffers: Sequence[np.ndarray], hashes: InputHashes | None = None
                       ) -> np.ndarray:
    """Tensor ``name`` averaged over the clients as :func:`average_tensor` does, streamed:
    each client's values are taken a piece at a time (at most ``PIECE_BYTES``), viewed in
    the file's mapped pages or read into the client's reused buffer (:meth:`Checkpoint.pieces`
    with ``mapped``; a tensor in memory is sliced) and summed in cache-sized blocks
    (:func:`weighted_sum`); nothing of the clients' tensor is kept and no float64 copy of it
    is made. A non-finite sum (any NaN or Inf among the
    inputs makes one) sends the tensor through :meth:`Checkpoint.tensor`, whose check names
    the client holding it. ``hashes``, if given, is fed every value read."""
    dtypes = {c.value_dtype(name) for c in checkpoints}
    if hashes is not None:
        hashes.begin(name)
    if not streamed(dtypes, name):
        arrays = [c.tensor(name) for c in checkpoints]
        if hashes is not None:
            hashes.feed(arrays)
            hashes.wait()
        fused = average_tensor(arrays, weights, name)
        for checkpoint in checkpoints:
            checkpoint.release(name)
        return fused
    shape = checkpoints[0].tensors[name].shape
    out = np.empty(math.prod(shape), dtype=dtypes.pop())
    scratch = np.empty((2, SUM_BLOCK), dtype=accumulator(out.dtype))
    first = 0
    for pieces in zip(*(c.pieces(name, PIECE_BYTES // 8, b, mapped=True)
                        for c, b in zip(checkpoints, buffers, strict=True)), strict=True):
        if hashes is not None:  # hashed on other threads while summed here
            hashes.feed(pieces)
        stop = first + len(pieces[0])
        weighted_sum(pieces, weights, out[first:stop], scratch)
        if count_non_finite(out[first:stop]):
            for checkpoint in checkpoints:  # raises, naming the client, if an input is bad
                checkpoint.tensor(name)
                checkpoint.release(name)
        first = stop
        if hashes is not None:  # the next pieces are read into the same buffers
            hashes.wait()
        del pieces  # mapped pieces are unmapped before the next ones are mapped
    return out.reshape(shape)


class InputHashes:
    """The clients' content hashes fed with the values the average reads, so that each
    input file is read once: tensors in sorted order (as :attr:`Checkpoint.content_hash`
    takes them), each round of pieces hashed on ``pool``'s ``HASH_THREADS`` threads while the main thread
    sums it. The values are checked by the average (a non-finite sum, or
    :meth:`Checkpoint.tensor` for tensors read whole), as the hash's own pass checks them.

    Only clients read from files whose tensors are the first client's are fed; the others
    (in memory, or with more tensors) hash themselves when asked."""

    def __init__(self, checkpoints: Sequence[Checkpoint], pool: ThreadPoolExecutor) -> None:
        names = sorted(checkpoints[0].tensors)
        self._fed = [(i, c, hashlib.sha256()) for i, c in enumerate(checkpoints)
                     if c.path is not None and sorted(c.tensors) == names
                     and "content_hash" not in vars(c)]  # not hashed already
        self._pool = pool
        self._pending: list[Future[None]] = []

    def begin(self, name: str) -> None:
        """Tensor ``name``'s values come next."""
        self.wait()
        for _, checkpoint, digest in self._fed:
            digest.update(checkpoint.hash_header(name))

    def feed(self, pieces: Sequence[np.ndarray]) -> None:
        """The clients' next values (one array per client, in the clients' order), hashed
        on the pool; they must stay unchanged until :meth:`wait` returns."""
        self.wait()
        work = [(digest, np.ascontiguousarray(pieces[i]).reshape(-1).view(np.uint8))
                for i, _, digest in self._fed]
        if sum(len(data) for _, data in work) < SMALL_HASH_BYTES:  # not worth a thread
            _update(work)
            return
        self._pending = [self._pool.submit(_update, work[k::HASH_THREADS])
                         for k in range(HASH_THREADS)]

    def wait(self) -> None:
        """Until the values fed so far are hashed."""
        for future in self._pending:
            future.result()
        self._pending = []

    def finish(self) -> None:
        """Every tensor fed: the hashes become the clients' content hashes."""
        self.wait()
        for _, checkpoint, digest in self._fed:
            checkpoint.adopt_content_hash(digest)


def _update(work: Sequence[tuple[Any, np.ndarray]]) -> None:
    for digest, data in work:
        digest.update(data)


def streamed(dtypes: set[np.dtype], name: str) -> bool:
    """Whether avg sums tensor ``name`` of these value types in blocks (:func:`weighted_sum`):
    floats of one type; mixed types, integers and checked variances go whole
    (:func:`average_tensor`)."""
    (dtype, *others) = dtypes
    return (not others and dtype.kind == "f" and not is_integer_buffer(name)
            and not name.endswith(VARIANCE_SUFFIXES))


def average_arrays(arrays: Sequence[np.ndarray], weights: np.ndarray, name: str) -> np.ndarray:
    """What avg gives for these clients' tensor ``name`` held in memory, bit for bit."""
    if not streamed({a.dtype for a in arrays}, name):
        return average_tensor(arrays, weights, name)
    out = np.empty(arrays[0].size, dtype=arrays[0].dtype)
    weighted_sum([a.reshape(-1) for a in arrays], weights, out,
                 np.empty((2, SUM_BLOCK), dtype=accumulator(out.dtype)))
    return out.reshape(arrays[0].shape)


def weighted_sum(arrays: Sequence[np.ndarray], weights: np.ndarray, out: np.ndarray,
                 scratch: np.ndarray) -> None:
    """``out = sum_s weights[s] * arrays[s]`` (1-D, equal sizes), ``SUM_BLOCK`` values at a
    time in ``scratch`` ((2, SUM_BLOCK) of :func:`accumulator`'s dtype for out's dtype)."""
    weights = weights.astype(scratch.dtype)  # a float64 weight would widen every product
    for first in range(0, len(out), SUM_BLOCK):
        stop = min(len(out), first + SUM_BLOCK)
        total, product = scratch[0, :stop - first], scratch[1, :stop - first]
        np.multiply(arrays[0][first:stop], weights[0], out=total)
        for weight, array in zip(weights[1:], arrays[1:], strict=True):
            total += np.multiply(array[first:stop], weight, out=product)
        out[first:stop] = total


def add_weighted(total: np.ndarray, weight: np.floating, array: np.ndarray) -> None:
    """``total += weight * array`` for a C-contiguous ``total`` (a running sum in its own
    dtype), the same values bit for bit, ``SUM_BLOCK`` values at a time: no temporary as
    large as the tensor (allocated and faulted in anew for every client and tensor)."""
    flat, values = total.reshape(-1), array.reshape(-1)
    product = np.empty(min(SUM_BLOCK, flat.size), dtype=total.dtype)
    for first in range(0, flat.size, SUM_BLOCK):
        stop = min(flat.size, first + SUM_BLOCK)
        part = np.multiply(values[first:stop], weight, out=product[:stop - first])
        flat[first:stop] += part


def accumulator(dtype: np.dtype) -> np.dtype:
    """The dtype a weighted sum of ``dtype`` values is accumulated in: float32 for float32
    and narrower outputs (its rounding error, a few units of float32's precision at the
    terms' magnitude, is that of the output's own rounding; benchmarks/RESULTS.md, issue 43),
    float64 for float64 outputs."""
    return np.dtype(np.float32 if np.dtype(dtype).itemsize <= 4 else np.float64)


def average_tensor(arrays: Sequence[np.ndarray], weights: np.ndarray, name: str) -> np.ndarray:
    """Weighted average in float64, cast back to the clients' dtype; counters take the max."""
    if is_integer_buffer(name):
        return np.max(np.stack(arrays), axis=0)
    total = np.zeros(arrays[0].shape, dtype=np.float64)
    for weight, array in zip(weights, arrays, strict=True):
        total += weight * array
    return total.astype(arrays[0].dtype)


def class_shares(checkpoints: Sequence[Checkpoint], n_classes: int) -> np.ndarray:
    """f_sk = N_sk / Σ_s N_sk, shape (S, K); a class no client saw gets uniform shares."""
    return shares_of_counts(class_counts_matrix(checkpoints, n_classes))


def shares_of_counts(counts: np.ndarray) -> np.ndarray:
    """f_sk = N_sk / Σ_s N_sk of (S, K) class counts; a class no client saw: uniform 1/S."""
    counts = np.asarray(counts, dtype=np.float64)
    totals = counts.sum(axis=0)
    uniform = np.full_like(counts, 1.0 / len(counts))
    return np.where(totals > 0, counts / np.where(totals > 0, totals, 1.0), uniform)


def class_counts_matrix(checkpoints: Sequence[Checkpoint], n_classes: int) -> np.ndarray:
    """(S, K) float64 class counts N_sk of every client (``fusekit.class_counts``).

    Raises:
        ParameterError: a client without class counts.
        IncompatibleModelsError: a client whose counts do not have one entry per class.
    """
    counts = []
    for c in checkpoints:
        if c.class_counts is None:
            raise ParameterError(
                f"class-weighted fusion needs {CLASS_COUNTS} metadata; {c.label} has none"
            )
        if c.class_counts.size != n_classes:
            raise IncompatibleModelsError(
                f"{c.label}: {CLASS_COUNTS} has {c.class_counts.size} entries; expected "
                f"{n_classes}, the number of outputs"
            )
        counts.append(c.class_counts)
    return np.stack(counts).astype(np.float64)


def information_shares(checkpoints: Sequence[Checkpoint], n_classes: int) -> np.ndarray:
    """g_sk = I_sk / sum_s I_sk with I_sk = N_sk (1 - N_sk / N_s), shape (S, K).

    I_sk is the Fisher information client s's labels carry about class k against the rest
    (N_s pi(1 - pi) at its base rate pi = N_sk / N_s, ALGORITHMS.md §3): a client that saw
    only class k learnt "everything is k" and gets no weight for k, however many samples
    it has. A class on which no client has information (only one-class clients hold it)
    gets the sample shares N_s / N, as coordinate averaging would give it.
    """
    information = class_information(class_counts_matrix(checkpoints, n_classes))
    totals = information.sum(axis=0)
    samples = np.repeat(sample_weights(checkpoints)[:, None], n_classes, axis=1)
    return np.where(totals > 0, information / np.where(totals > 0, totals, 1.0), samples)


def class_information(counts: np.ndarray) -> np.ndarray:
    """I_sk = N_sk (1 - N_sk / N_s) from (S, K) class counts (see :func:`information_shares`)."""
    return counts * (1.0 - counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0))


def check_equal_shapes(checkpoints: Sequence[Checkpoint]) -> None:
    """Coordinate averaging needs every tensor to have the same shape in every client."""
    first = checkpoints[0]
    for other in checkpoints[1:]:
        for name, info in first.tensors.items():
            if other.tensors[name].shape != info.shape:
                raise IncompatibleModelsError(
                    f"tensor {name!r} has shape {other.tensors[name].shape} in {other.label} "
                    f"but {info.shape} in {first.label}; 'avg' needs equal shapes (use a "
                    "matching method such as pfnm for clients of different widths)"
                )


def check_same_shapes(checkpoints: Sequence[Checkpoint], names: Sequence[str]) -> None:
    """Tensors outside the matched layers are averaged as they are: equal shapes needed."""
    for name in names:
        shapes = {c.tensors[name].shape for c in checkpoints}
        if len(shapes) > 1:
            raise IncompatibleModelsError(
                f"tensor {name!r} is outside the matched layers and its shape differs between "
                f"clients ({sorted(shapes)}); describe it in a JSON spec file (--spec) or fuse "
                "with avg"
            )
