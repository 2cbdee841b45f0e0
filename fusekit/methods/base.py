"""The fusion-method protocol, its registry, and what every method returns."""

from __future__ import annotations

import functools
import inspect
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np

from fusekit._version import __version__
from fusekit.core import metadata as meta
from fusekit.core.checkpoint import (
    Checkpoint,
    common_preprocess,
    save_checkpoint,
    save_model_folder,
)
from fusekit.core.errors import UnknownMethodError
from fusekit.core.neurons import refuse_position_aware
from fusekit.core.spec import PermutationSpec
from fusekit.core.transformer import TransformerSpec, config_with_widths
from fusekit.engine.offload import on_device

log = logging.getLogger(__name__)


@dataclass
class FusionResult:
    """A fused model and how it was made.

    Attributes:
        state_dict: tensor name -> numpy array, in the clients' dtype.
        method: the method's registry name.
        params: the parameters the method ran with (JSON-able).
        widths: hidden widths of the fused model, input to output.
        report: per-method details (timings, per-layer matching statistics), JSON-able.
        metadata: safetensors metadata written by :meth:`save` (arch, provenance).
        inputs: the input files, which :meth:`save` refuses to replace.
        assignments: for methods that match neurons, per client (canonical order) and per
            permutation group, the fused neuron each client neuron went into ((J_s,) int,
            -1 for none); calibration takes its targets through them (ALGORITHMS §12).
        config: for Hugging Face model folders, the fused model's config.json (widths
            updated); :meth:`save` then writes a model folder.
    """

    state_dict: dict[str, np.ndarray]
    method: str
    params: dict[str, Any]
    widths: list[int]
    report: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    inputs: list[Path] = field(default_factory=list)
    assignments: list[list[np.ndarray]] | None = None
    spec: Any = None  # the fused model's PermutationSpec / GraphSpec
    config: dict[str, Any] | None = None

    def save(self, path: str | Path, *, force: bool = False) -> Path:
        """Write the fused model atomically: a safetensors file (see
        :func:`save_checkpoint`), or, when the clients were Hugging Face model folders, a
        folder with ``config.json`` and ``model.safetensors`` that ``from_pretrained``
        loads (see :func:`save_model_folder`)."""
        if self.config is not None:
            return save_model_folder(path, self.state_dict, self.metadata, self.config,
                                     force=force, inputs=self.inputs)
        return save_checkpoint(path, self.state_dict, self.metadata, force=force,
                               inputs=self.inputs)

class FusionMethod(ABC):
    """One fusion method. Subclasses set ``name``/``summary`` and implement :meth:`fuse`.

    The keyword-only parameters of ``fuse`` (with defaults, described with
    ``Annotated[T, Param(...)]``, see :mod:`fusekit.methods.params`) are the method's
    parameters, declared once: ``fusekit.fuse`` validates values against them, the CLI
    builds its options from them and docs/PARAMETERS.md is generated from them.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    #: True when the method permutes neurons (it must refuse position-aware neurons).
    permutes_neurons: ClassVar[bool] = False
    #: False for methods that keep every client's model as it is (AMS): fusekit.fuse then
    #: skips the same-layers check and the method checks what it needs itself.
    requires_same_architecture: ClassVar[bool] = True
    #: True for methods that fuse residual networks (GraphSpec: permutation groups shared
    #: by several layers); the others refuse them.
    handles_groups: ClassVar[bool] = False
    #: True for methods that fuse transformers (TransformerSpec: heads, LayerNorms, a
    #: residual stream; Hugging Face model folders); the others refuse them.
    handles_transformers: ClassVar[bool] = False
    #: The ``fusekit.arch`` entry every client must have (``"fed2"`` for Fed² models), or
    #: None for methods that fuse any model; front doors that train plain clients skip it.
    client_structure: ClassVar[str | None] = None
    #: True for methods that fold BatchNorms into their layers and write them back as the
    #: identity (ALGORITHMS §2): fusion then records the affine calibration restores.
    folds_batchnorm: ClassVar[bool] = False
    #: False for methods whose result is not one network (AMS keeps every client's side by
    #: side): there is no fused network to calibrate (ALGORITHMS §12).
    makes_one_network: ClassVar[bool] = True
    #: True for methods that read every value of every input and feed the inputs' content
    #: hashes as they go (Checkpoint.adopt_content_hash): fusekit.fuse then starts no
    #: threads that read the files again to hash them.
    hashes_inputs: ClassVar[bool] = False

    @abstractmethod
    def fuse(
        self, checkpoints: Sequence[Checkpoint], specs: Sequence[PermutationSpec], **params: Any
    ) -> FusionResult:
        """Fuse clients given in canonical order, each with its permutation spec."""

    def check_client(self, checkpoint: Checkpoint, spec: PermutationSpec) -> None:
        """Refuse, with the reason :meth:`fuse` gives, a client this method cannot fuse
        whatever the other clients are; for front doors that screen clients one by one
        (a Flower round leaves such a reply out). :meth:`fuse` checks again.

        Raises:
            IncompatibleModelsError: position-aware or Fed² neurons, for a method that
                permutes neurons.
        """
        if self.permutes_neurons:
            refuse_position_aware([checkpoint], [spec], self.name)

    def result(
        self,
        state_dict: dict[str, np.ndarray],
        checkpoints: Sequence[Checkpoint],
        spec: PermutationSpec,
        params: dict[str, Any],
        report: dict[str, Any] | None = None,
        assignments: list[list[np.ndarray]] | None = None,
    ) -> FusionResult:
        """Package a fused state_dict with its metadata (fused spec and architecture)."""
        from fusekit.core.arch import infer_arch

        metadata = {meta.SPEC: json.dumps(spec.to_json())}
        first = checkpoints[0]
        arch = first.arch if first.arch is not None else infer_arch(
            {name: info.shape for name, info in first.tensors.items()})
        if arch is not None:
            metadata[meta.ARCH] = json.dumps(_arch_with_widths(arch, spec.hidden_widths))
        config = None
        if first.config is not None and isinstance(spec, TransformerSpec):
            config = config_with_widths(first.config, spec)
        return FusionResult(
            state_dict=state_dict,
            method=self.name,
            params=params,
            widths=spec.hidden_widths,
            report=report or {},
            metadata=metadata,
            assignments=assignments,
            spec=spec,
            config=config,
        )

Fuse = Callable[..., FusionResult]


def places_cost_kernels(fuse: Fuse) -> Fuse:
    """Decorate a method's ``fuse`` that declares ``device`` (:data:`~fusekit.methods.params.
    Device`): it runs inside :func:`fusekit.engine.offload.on_device` with that device, so
    the engine's cost matrices go there; the result's params record the device and its
    report where the matrices went (``report["cost_matrices"]``).

    Raises (from the call):
        ParameterError: a device that is not auto, cpu or cuda[:N], or not present.
    """
    default = inspect.signature(fuse).parameters["device"].default

    @functools.wraps(fuse)
    def placed(self: FusionMethod, checkpoints: Sequence[Checkpoint],
               specs: Sequence[PermutationSpec], **params: Any) -> FusionResult:
        device = params.get("device", default)
        with on_device(device) as placement:
            result = fuse(self, checkpoints, specs, **params)
        result.params.setdefault("device", device)
        result.report["cost_matrices"] = placement.summary()
        return result

    return placed


def _arch_with_widths(arch: dict[str, Any], widths: list[int]) -> dict[str, Any]:
    from fusekit.core.arch import hidden_widths, with_hidden_widths

    return arch if hidden_widths(arch) == widths else with_hidden_widths(arch, widths)

def provenance(result: FusionResult, checkpoints: Sequence[Checkpoint]) -> None:
    """Add method, parameters, input hashes and version to the result's metadata, and the
    input files to ``result.inputs``."""
    result.inputs = [c.path.absolute() for c in checkpoints if c.path is not None]
    result.metadata.update({
        meta.METHOD: result.method,
        meta.PARAMS: json.dumps(result.params, sort_keys=True),
        meta.INPUTS: json.dumps([c.content_hash for c in checkpoints]),
        meta.VERSION: __version__,
    })
    preprocess = common_preprocess(checkpoints)
    if preprocess is not None:  # the fused model takes the inputs its clients took
        result.metadata[meta.PREPROCESS] = preprocess.to_json()

def sample_weights(checkpoints: Sequence[Checkpoint]) -> np.ndarray:
    """α_s = N_s / Σ N (ALGORITHMS §1); uniform, with a warning, when any count is missing."""
    counts = [c.num_samples for c in checkpoints]
    if any(n is None for n in counts):
        missing = [c.label for c, n in zip(checkpoints, counts, strict=True) if n is None]
        log.warning("no %s metadata in %s: weighting clients uniformly",
                    meta.NUM_SAMPLES, ", ".join(missing))
        return np.full(len(checkpoints), 1.0 / len(checkpoints))
    weights = np.asarray(counts, dtype=np.float64)
    return weights / weights.sum()

METHODS: dict[str, type[FusionMethod]] = {}

M = TypeVar("M", bound=type[FusionMethod])

def register(cls: M) -> M:
    """Class decorator adding a method to :data:`METHODS` under ``cls.name``."""
    METHODS[cls.name] = cls
    return cls

def get_method(name: str) -> FusionMethod:
    """An instance of the registered method ``name``."""
    try:
        return METHODS[name]()
    except KeyError:
        raise UnknownMethodError(
            f"unknown fusion method {name!r}; choose one of: {', '.join(sorted(METHODS))}"
        ) from None
