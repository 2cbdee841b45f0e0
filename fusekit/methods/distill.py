"""Data-free distillation (docs/ALGORITHMS.md §14): a fused student taught the clients'
ensemble on synthetic inputs made from the models alone.

The student starts as another method's fusion (PFNM at its default width unless told
otherwise), the teacher is the best ensemble fusekit has (AMS's class-share mixture when
every client carries class counts, else the softmax average), and the inputs are drawn
fresh for every step (in the span of the clients' first-layer weights for MLPs, else from a
standard normal) and moved a few steps toward what the teacher
and a client holding the input's label answer confidently and the student gets wrong (DeepInversion, CVPR 2020; DENSE, NeurIPS
2022), with the clients' BatchNorm statistics as a prior where they have BatchNorm; the
student can learn from a pool of earlier batches beside each fresh one. A GPT-2
language model's inputs are token sequences sampled from the ensemble instead (a share of
the tokens uniform); a ViT's are pixel values drawn and moved like any image.

The server uses the client checkpoints' tensors and their class counts; no data of any
kind. This module declares the method and runs the initial fusion (torch-free); the
training itself is torch and lives in :mod:`fusekit.toolkit.distill`, which the toolkit
installs with :func:`set_student_trainer` when it is imported (``fusekit.fuse`` imports
it): methods never import the toolkit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np

from fusekit.core import metadata as meta
from fusekit.core.checkpoint import HF_PROCESSOR, Checkpoint, image_processor
from fusekit.core.errors import CheckpointError, IncompatibleModelsError, ParameterError
from fusekit.core.spec import PermutationSpec
from fusekit.core.transformer import TransformerSpec
from fusekit.methods.avg import class_counts_matrix, shares_of_counts
from fusekit.methods.base import (
    METHODS,
    FusionMethod,
    FusionResult,
    get_method,
    places_cost_kernels,
    register,
)
from fusekit.methods.bayesian import DEFAULT_WIDTH_RATIO
from fusekit.methods.params import Device, Param, method_params

#: Methods whose fusion can start the student: every registered one that makes one
#: network of the clients' architecture (fed2 needs clients of its own structure).
INITIAL_FUSIONS = tuple(sorted(name for name, cls in METHODS.items()
                               if cls.makes_one_network and cls.client_structure is None))

#: Where a synthetic batch starts (ALGORITHMS §14): the span of the clients' first-layer
#: weights (the directions training moved them in, i.e. the data's), its principal
#: directions above the initialisations' noise, or N(0, I).
INPUT_PRIORS = ("weights", "principal", "normal")


@dataclass(frozen=True)
class DistillationTask:
    """What the student's training gets: models and settings, no data.

    Attributes:
        clients: the client checkpoints, canonical order.
        specs: their permutation specs.
        student: the initial fusion (its state_dict, spec and architecture metadata).
        class_shares: (S, C) float64 f_sc = N_sc / sum_s N_sc, or None without class counts
            (the teacher is then the softmax average).
        class_prior: (C,) float64 share of each class in all clients' samples (uniform
            without class counts): the labels the synthetic batches are drawn for.
        input_shape: one input's shape, e.g. (64,) or (1, 8, 8).
        settings: the training parameters (steps, batch, ... as declared by :class:`Distill`).
        input_range: per channel, the lowest and highest value a pixel can have in the
            space the model computes in (from a ViT folder's image processor), or None.
    """

    clients: Sequence[Checkpoint]
    specs: Sequence[PermutationSpec]
    student: FusionResult
    class_shares: np.ndarray | None
    class_prior: np.ndarray
    input_shape: tuple[int, ...]
    settings: Mapping[str, Any]
    input_range: tuple[np.ndarray, np.ndarray] | None = None


#: task -> (the student's state_dict, numpy, same names and dtypes; a report, JSON-able).
StudentTrainer = Callable[[DistillationTask], tuple[dict[str, np.ndarray], dict[str, Any]]]
_trainer: list[StudentTrainer] = []


def set_student_trainer(trainer: StudentTrainer) -> None:
    """Install the training stage (``fusekit.toolkit.distill.train_student``)."""
    _trainer[:] = [trainer]


@register
class Distill(FusionMethod):
    name = "distill"
    summary = ("a fusion (pfnm by default) taught the clients' class-aware ensemble on "
               "synthetic inputs made from the models alone (torch)")
    handles_groups = True  # residual networks: the student is the fusion's network
    handles_transformers = True  # ViTs and GPT-2 language models (ALGORITHMS §14)

    @places_cost_kernels
    def fuse(
        self,
        checkpoints: Sequence[Checkpoint],
        specs: Sequence[PermutationSpec],
        *,
        initial: Annotated[str, Param(
            help="the fusion the student starts from (its default parameters)",
            choices=INITIAL_FUSIONS)] = "pfnm",
        width_ratio: Annotated[float | None, Param(
            help="the student's hidden width relative to the widest client, for initial "
            "fusions that choose a width (pfnm, nafi)", minimum=1,
            default_text=f"{DEFAULT_WIDTH_RATIO} for pfnm and nafi")] = None,
        steps: Annotated[int, Param(
            help="student updates, one fresh synthetic batch each (fewer when the stopping "
            "rule ends the run)", minimum=1, maximum=100_000)] = 200,
        batch: Annotated[int, Param(help="synthetic inputs per step", minimum=2,
                                    maximum=65_536)] = 256,
        input_steps: Annotated[int, Param(
            help="gradient steps that move each fresh batch from the prior toward "
            "confident, disputed inputs (0: the prior's draws as they are)", minimum=0,
            maximum=100)] = 3,
        input_lr: Annotated[float, Param(help="Adam learning rate of the synthetic inputs",
                                         above=0, maximum=10)] = 0.1,
        replay: Annotated[int, Param(
            help="inputs per fresh synthetic input that each student update also learns "
            "from, drawn from the pool of earlier steps' inputs with the teacher's answers "
            "kept (0: the fresh batch alone; language models: always 0)",
            minimum=0, maximum=100)] = 0,
        pool: Annotated[int, Param(help="synthetic inputs the replay pool keeps (the latest; "
                                        "fewer where they would take more than 1 GiB)",
                                   minimum=1, maximum=10_000_000)] = 16_384,
        adversarial: Annotated[float, Param(
            help="weight of the student's disagreement with the teacher, maximised by the "
            "inputs", paper="DENSE (NeurIPS 2022) Eq. 6", minimum=0)] = 1.0,
        experts: Annotated[float, Param(
            help="weight of each synthetic input's expert's confidence in its label (the "
            "expert: a client drawn by its share of the label's samples), which moves "
            "inputs into the region where the clients that hold a class answer it", minimum=0)
        ] = 1.0,
        batchnorm: Annotated[float, Param(
            help="weight of the clients' BatchNorm statistics as the inputs' prior (clients "
            "with BatchNorm only)", paper="DeepInversion (CVPR 2020) Eq. 4", minimum=0)] = 1.0,
        temperature: Annotated[float, Param(
            help="softening of the teacher's and the student's answers in the student's "
            "KL loss", paper="Hinton et al. 2015", above=0, maximum=100)] = 1.0,
        teacher_temperature: Annotated[float, Param(
            help="temperature of the teacher's answers that the student learns on the "
            "synthetic inputs whose top class is the label they were made for (below 1: "
            "sharper; 0.01: nearly that class alone; the other inputs' answers as they are). "
            "The class-share mixture, renormalised, is nearly flat where clients hold "
            "different classes; sharpened, the student follows its top class: better where "
            "that is well above the student, worse where the student taught it as it is "
            "beats it", above=0, maximum=100)] = 1.0,
        lr: Annotated[float, Param(help="Adam learning rate of the student", above=0,
                                   maximum=1)] = 1e-3,
        proximal: Annotated[float, Param(
            help="weight of the squared distance of the student's weights to its initial "
            "fusion (a proximal term)", paper="FedProx (MLSys 2020) Eq. 2", minimum=0)] = 0.0,
        patience: Annotated[int, Param(
            help="stop when the disagreement on fresh batches has not reached a new low for "
            "this many steps (0: run every step)", minimum=0)] = 50,
        image_size: Annotated[int | None, Param(
            help="height and width of the synthetic images of convolutional models that do "
            "not record theirs (ResNets, VGGs)", minimum=1, maximum=4096,
            default_text="the recorded size")] = None,
        sequence_length: Annotated[int | None, Param(
            help="tokens in each synthetic sequence of a language model (GPT-2), sampled "
            "from the clients' ensemble", minimum=2, maximum=65_536,
            default_text="the model's n_positions")] = None,
        exploration: Annotated[float, Param(
            help="share of the tokens of a language model's synthetic sequences drawn "
            "uniformly from the vocabulary instead of from the clients' ensemble (diversity: "
            "clients trained on answers alone repeat their prompts' tokens)", minimum=0,
            maximum=1)] = 0.5,
        prior: Annotated[str, Param(
            help="where each batch starts: weights = random combinations of the clients' "
            "centred first-layer weight rows, scaled to unit variance per input, principal = "
            "of their principal directions above the initialisations' noise (MLPs; "
            "convolutional models draw normal), normal = N(0, I)",
            choices=INPUT_PRIORS)] = "weights",
        seed: Annotated[int, Param(help="seed of the synthetic inputs and labels",
                                   minimum=0)] = 0,
        device: Device = "auto",
        threads: Annotated[int, Param(
            help="CPU threads of the training (its small products run slower split across "
            "threads: 18 s on one, 85 s on two for a digits cell on a busy 2-core machine)",
            minimum=1, maximum=1024)] = 1,
    ) -> FusionResult:
        """Fuse with ``initial``, then distil the clients' ensemble into that model.

        Args:
            checkpoints, specs: the S clients in canonical order and their specs.
            initial: the method whose fused model starts the student.
            width_ratio: the student's width relative to the widest client (``initial``
                pfnm or nafi); the other initial fusions keep the clients' width.
            steps, batch, input_steps, input_lr, replay, pool, adversarial, experts,
                batchnorm, temperature, teacher_temperature, lr, proximal, patience,
                image_size,
                sequence_length, exploration, prior, seed, device, threads: the training's
                settings (see the declaration above and ALGORITHMS.md §14).

        Returns:
            FusionResult of the student (the initial fusion's widths and architecture);
            ``report["initial"]`` is the initial fusion's report, ``report["distill"]``
            what the training used and reached.

        Raises:
            ParameterError: width_ratio for an initial fusion without one; no training stage
                installed (import ``fusekit.toolkit``; ``fusekit.fuse`` does).
            IncompatibleModelsError: convolutional models whose image size is neither
                recorded nor given.
        """
        input_shape = _input_shape(checkpoints[0], specs[0], image_size, sequence_length)
        fusion = get_method(initial)
        declared = {p.name for p in method_params(fusion)}
        options: dict[str, Any] = {"device": device} if "device" in declared else {}
        if width_ratio is not None:
            if "width_ratio" not in declared:
                raise ParameterError(f"width_ratio: initial fusion {initial!r} keeps the "
                                     "clients' width; use pfnm or nafi to choose one")
            options["width_ratio"] = width_ratio
        student = fusion.fuse(checkpoints, specs, **options)
        if not _trainer:
            raise ParameterError("method 'distill' trains its student with torch: import "
                                 "fusekit.toolkit (fusekit.fuse does) to install its training")
        settings = {"steps": steps, "batch": batch, "input_steps": input_steps,
                    "input_lr": input_lr, "replay": replay, "pool": pool,
                    "adversarial": adversarial, "experts": experts,
                    "batchnorm": batchnorm,
                    "temperature": temperature, "teacher_temperature": teacher_temperature,
                    "lr": lr, "proximal": proximal,
                    "patience": patience, "exploration": exploration, "prior": prior,
                    "seed": seed, "device": device, "threads": threads}
        shares, class_prior = _class_shares(checkpoints, _classes(checkpoints[0], specs[0]))
        task = DistillationTask(checkpoints, specs, student, shares, class_prior, input_shape,
                                settings, _common_pixel_range(checkpoints, input_shape))
        state_dict, trained = _trainer[0](task)
        params = {"initial": initial, "width_ratio": width_ratio, "image_size": image_size,
                  "sequence_length": sequence_length, **settings}
        report = {"initial": {"method": initial, "params": student.params,
                              **{k: v for k, v in student.report.items() if k != "layers"}},
                  "distill": trained}
        return self.result(state_dict, checkpoints, student.spec, params, report)


def _class_shares(checkpoints: Sequence[Checkpoint], classes: int
                  ) -> tuple[np.ndarray | None, np.ndarray]:
    """The class-share rule's f_sc and the classes' prior, when every client has counts."""
    if any(c.class_counts is None for c in checkpoints):
        return None, np.full(classes, 1.0 / classes)
    counts = class_counts_matrix(checkpoints, classes)
    totals = counts.sum(axis=0)
    prior = totals / totals.sum() if totals.sum() > 0 else np.full(classes, 1.0 / classes)
    return shares_of_counts(counts), prior


def _common_pixel_range(checkpoints: Sequence[Checkpoint], input_shape: tuple[int, ...]
                        ) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`_pixel_range` of the clients, which must agree.

    Raises:
        IncompatibleModelsError: two clients' processors give different pixel ranges.
    """
    ranges = [_pixel_range(c, input_shape) for c in checkpoints]
    for checkpoint, other in zip(checkpoints[1:], ranges[1:]):
        if (other is None) != (ranges[0] is None) or (other is not None and not all(
                np.allclose(a, b) for a, b in zip(other, ranges[0], strict=True))):
            raise IncompatibleModelsError(
                f"{checkpoint.label}: its {HF_PROCESSOR} gives pixels in {_said(other)}; "
                f"{checkpoints[0].label}'s in {_said(ranges[0])}; expected clients that "
                "take the same inputs")
    return ranges[0]


def _said(bounds: tuple[np.ndarray, np.ndarray] | None) -> str:
    return "no recorded range" if bounds is None else (
        f"[{bounds[0].round(4).tolist()}, {bounds[1].round(4).tolist()}]")


def _pixel_range(checkpoint: Checkpoint, input_shape: tuple[int, ...]
                 ) -> tuple[np.ndarray, np.ndarray] | None:
    """Per channel, the range (low, high) of a pixel as the model sees it, from the image
    processor its folder records: pixels 0..255 times ``rescale_factor`` (when
    ``do_rescale``), then (x - image_mean) / image_std (when ``do_normalize``); None
    without a processor.

    Raises:
        CheckpointError: the processor's values are not numbers, or not one or one per
            channel, or a std is not positive.
    """
    settings = image_processor(checkpoint) if len(input_shape) == 3 else None
    if settings is None:
        return None
    channels = input_shape[0]
    top = 255.0 * float(settings.get("rescale_factor", 1 / 255)) if settings.get(
        "do_rescale", True) else 255.0

    def per_channel(key: str, default: float) -> np.ndarray:
        value = settings.get(key, default) if settings.get("do_normalize", True) else default
        values = np.atleast_1d(np.asarray(value, dtype=object))
        if values.size not in (1, channels) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                for v in values):
            raise CheckpointError(f"{checkpoint.label}: {HF_PROCESSOR} {key}: expected a "
                                  f"number or {channels} numbers, found {value!r}")
        return np.broadcast_to(values.astype(np.float64), (channels,))

    mean, std = per_channel("image_mean", 0.0), per_channel("image_std", 1.0)
    if (std <= 0).any():
        raise CheckpointError(f"{checkpoint.label}: {HF_PROCESSOR} image_std: expected "
                              f"positive numbers, found {std.tolist()}")
    return (0.0 - mean) / std, (top - mean) / std


def _classes(checkpoint: Checkpoint, spec: PermutationSpec | TransformerSpec) -> int:
    """The teacher's outputs: classes, or a language model's vocabulary."""
    if not isinstance(spec, TransformerSpec):
        return spec.out_features
    config = checkpoint.config or {}
    if config.get("model_type") == "gpt2":
        return int(config["vocab_size"])
    return int(checkpoint.tensors["classifier.weight"].shape[0])


def _input_shape(checkpoint: Checkpoint, spec: PermutationSpec | TransformerSpec,
                 image_size: int | None, sequence_length: int | None) -> tuple[int, ...]:
    """One input's shape: an MLP's fan-in; a convolutional model's (C, H, W), H and W from
    its ``fusekit.arch`` (a ConvNet's image_size) or else ``image_size``; a ViT's (C, H, W)
    from its config.json; a GPT-2's (tokens,), ``sequence_length`` or its n_positions.

    Raises:
        IncompatibleModelsError: a convolutional model whose image size is neither recorded
            nor given; a transformer that is neither a ViT nor a GPT-2 language model; a
            sequence longer than the model's positions.
    """
    if isinstance(spec, TransformerSpec):
        return _transformer_input_shape(checkpoint, spec, sequence_length)
    arch = checkpoint.arch or {}
    if arch.get("type") == "convnet" and "image_size" in arch:
        return (int(arch["in_channels"]), *map(int, arch["image_size"]))
    shape = checkpoint.tensors[spec.layers[0].weight].shape
    if len(shape) == 2:
        return (int(shape[1]),)
    if image_size is not None:
        return (int(shape[1]), image_size, image_size)
    raise IncompatibleModelsError(
        f"{checkpoint.label}: distill needs the inputs' image size, which a ConvNet records "
        f"in {meta.ARCH} (type convnet, image_size) and other convolutional models take from "
        f"image_size; found {json.dumps(arch) if arch else 'no architecture'} and no "
        "image_size")


def _transformer_input_shape(checkpoint: Checkpoint, spec: TransformerSpec,
                             sequence_length: int | None) -> tuple[int, ...]:
    """A ViT's pixel values (C, H, W) or a GPT-2 language model's token sequence (L,)."""
    config = checkpoint.config or {}
    names = config.get("architectures") or []
    if spec.family == "vit" and "classifier.weight" in checkpoint.tensors:
        size = config.get("image_size", 224)
        height, width = (size, size) if isinstance(size, int) else size
        return (int(config.get("num_channels", 3)), int(height), int(width))
    if spec.family == "gpt2" and names[:1] == ["GPT2LMHeadModel"]:
        positions = int(config.get("n_positions", 1024))
        length = positions if sequence_length is None else sequence_length
        if length > positions:
            raise IncompatibleModelsError(
                f"{checkpoint.label}: sequence_length {length} exceeds the model's "
                f"n_positions {positions}; expected at most {positions}")
        return (length,)
    raise IncompatibleModelsError(
        f"{checkpoint.label}: distill synthesises pixel values for ViT classifiers and "
        "samples token sequences from GPT-2 language models (GPT2LMHeadModel); found a "
        f"{spec.family} model ({', '.join(names) or 'config.json names no class'})")
