"""Cost matrices on an accelerator when one is present; the engine's door for kernels it
cannot hold itself.

The engine and the methods are torch-free. The toolkit installs a factory of torch kernels
with :func:`set_accelerator` when it is imported (``fusekit.fuse`` imports it), as it
installs distillation's training stage. A fusion runs inside ``with on_device(device):``
(methods with a ``device`` parameter do, see :func:`fusekit.methods.base.places_cost_kernels`),
and the engine's cost kernels (:func:`~fusekit.engine.matching.sqeuclidean_cost`,
:func:`~fusekit.engine.matching.pfnm_cost`, :func:`~fusekit.engine.matching.nafi_cost`,
:func:`~fusekit.engine.matching.inner_products`) then ask :func:`accelerator_for` whether one
problem goes to the device:

- ``"cpu"``: never; the C++ core computes every matrix (the path without an accelerator);
- ``"cuda"`` / ``"cuda:N"``: always (the device is checked when the block is entered);
- ``"auto"``: problems of at least :data:`AUTO_MIN_FLOPS`, when a CUDA device is present,
  once the fusion has computed :data:`AUTO_START_FLOPS` of such problems on the CPU (about
  what importing torch and starting CUDA cost, a few seconds, which a fusion with few large
  matrices would not win back). torch is imported only on a machine whose NVIDIA driver is
  loaded, so a machine without a GPU, or a fusion of small layers, never pays for it.

The assignment solver stays on the CPU (the C++ core): the plans are combinatorial, the
cost matrices are the arithmetic. The device kernels compute what the C++ kernels do, in
float64, to rounding (tests/test_gpu_costs.py).

The setting is a context variable: like torch's default device, it holds in the thread that
entered the block; a pool of worker threads that should share it runs its tasks in
``contextvars.copy_context()``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fusekit.core.errors import ParameterError

__all__ = [
    "AUTO_MIN_FLOPS",
    "AUTO_START_FLOPS",
    "Accelerator",
    "Placement",
    "accelerator_for",
    "on_device",
    "set_accelerator",
]

#: ``auto`` sends a cost matrix to the device from this many flops of its products (2 n m p):
#: about 10 ms of float64 BLAS on 2 cores, against well under 1 ms for the transfers and
#: kernel launches of a matrix that size on a current GPU.
AUTO_MIN_FLOPS = 2.0**28
#: ``auto`` starts the device (imports torch, starts CUDA: seconds) once the problems of at
#: least AUTO_MIN_FLOPS computed on the CPU reach this many flops in total (34 GFLOP: one to
#: two seconds of float64 BLAS on 2 cores).
AUTO_START_FLOPS = 2.0**35

_DEVICE_TEXT = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class Accelerator:
    """Cost kernels bound to one device, with the CPU kernels' signatures and results
    (``fusekit._core.sqeuclidean_cost`` / ``posterior_cost``: contiguous float64 numpy
    arrays in, a float64 numpy matrix out; ``inner_products`` as the engine's).

    Attributes:
        device: where they run, e.g. ``"cuda:0"``.
        sqeuclidean_cost: ``(a (n, p), b (m, p)) -> (n, m)``.
        posterior_cost: ``(local, client_precision, global_sums, global_precisions,
            global_counts, mu0, sigma0_2, n_clients, gamma0, lam) -> (J_g + J_l, J_l)``.
        inner_products: ``[(a_k (n, p_k), b_k (m, p_k)), ...] -> (n, m)``.
    """

    device: str
    sqeuclidean_cost: Callable[[np.ndarray, np.ndarray], np.ndarray]
    posterior_cost: Callable[..., np.ndarray]
    inner_products: Callable[[list[tuple[np.ndarray, np.ndarray]]], np.ndarray]


#: device text ("auto" or "cuda[:N]") -> its Accelerator, or None for "auto" without a CUDA
#: device. Raises ParameterError for a named device that is not there.
AcceleratorFactory = Callable[[str], "Accelerator | None"]
_factory: list[AcceleratorFactory] = []


def set_accelerator(factory: AcceleratorFactory) -> None:
    """Install the device kernels (``fusekit.toolkit`` installs its torch kernels)."""
    _factory[:] = [factory]


@dataclass
class Placement:
    """Where one fusion's cost matrices go, and where they went.

    Attributes:
        device: as asked: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        accelerator: the device kernels once resolved (``auto`` resolves once its large
            problems reach AUTO_START_FLOPS); None: every matrix on the CPU.
        on_device, on_cpu: cost matrices computed on each side so far.
        waiting_flops: ``auto``'s large problems computed on the CPU before it resolved.
    """

    device: str
    accelerator: Accelerator | None = None
    resolved: bool = False
    on_device: int = 0
    on_cpu: int = 0
    waiting_flops: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def summary(self) -> dict[str, Any]:
        """JSON-able: what a fusion's report records."""
        return {"device": self.device,
                "ran_on": self.accelerator.device if self.accelerator else "cpu",
                "matrices_on_device": self.on_device, "matrices_on_cpu": self.on_cpu}

    def choose(self, flops: float) -> Accelerator | None:
        """The kernels for one problem of ``flops`` (None: the C++ core), counted."""
        accelerator = None
        if self.device != "cpu" and (self.device != "auto" or self._worth_starting(flops)):
            accelerator = self.resolve()
        with self._lock:
            if accelerator is None:
                self.on_cpu += 1
            else:
                self.on_device += 1
        return accelerator

    def _worth_starting(self, flops: float) -> bool:
        """``auto``: whether a problem of ``flops`` goes to the device (once found)."""
        if flops < AUTO_MIN_FLOPS:
            return False
        with self._lock:
            if self.resolved or self.waiting_flops + flops >= AUTO_START_FLOPS:
                return True
            self.waiting_flops += flops
            return False

    def resolve(self) -> Accelerator | None:
        """The device kernels, made at the first call (None: ``auto`` found no device)."""
        with self._lock:
            if not self.resolved:
                if self.device != "auto" or _driver_loaded():
                    self.accelerator = _make(self.device)
                self.resolved = True
            return self.accelerator


_placement: contextvars.ContextVar[Placement | None] = contextvars.ContextVar(
    "fusekit_cost_placement", default=None)


def _make(device: str) -> Accelerator | None:
    if not _factory:
        if device == "auto":
            return None
        raise ParameterError(
            f"device: {device!r} computes cost matrices with torch, whose kernels are not "
            "installed: import fusekit.toolkit first (fusekit.fuse does)")
    return _factory[0](device)


def _driver_loaded() -> bool:
    """Whether this machine may have a CUDA device, decided without importing torch: an
    NVIDIA driver is loaded and CUDA_VISIBLE_DEVICES does not hide every device."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return Path("/proc/driver/nvidia/version").exists() or any(Path("/dev").glob("nvidia*"))


@contextlib.contextmanager
def on_device(device: str = "auto") -> Iterator[Placement]:
    """Compute the engine's cost matrices inside the block on ``device`` (module docstring).

    Args:
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

    Yields:
        The block's :class:`Placement` (its ``summary()`` says where matrices went).

    Raises:
        ParameterError: another device text; ``cuda`` without torch's kernels installed
            or without a CUDA device (checked on entry, before any work).
    """
    if not isinstance(device, str) or not _DEVICE_TEXT.fullmatch(device):
        raise ParameterError(f"device: expected auto, cpu or cuda[:N], found {device!r}")
    placement = Placement(device)
    if device.startswith("cuda"):
        placement.resolve()
    token = _placement.set(placement)
    try:
        yield placement
    finally:
        _placement.reset(token)


def accelerator_for(flops: float) -> Accelerator | None:
    """The device kernels for one cost matrix of ``flops`` (2 n m p of its products) in
    the current :func:`on_device` block, or None: compute it on the CPU (outside any block
    too)."""
    placement = _placement.get()
    return None if placement is None else placement.choose(flops)
