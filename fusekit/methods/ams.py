"""AMS, adaptive model selection (ALGORITHMS.md §6; AMS paper §5, Eq. 7-9, Algorithms 1-2).

AMS averages nothing: the fused artefact keeps every client's model, and at inference each
input is answered by the model(s) with the largest "absolute confidence" max_c f_s,c(x).
The artefact is one safetensors file: client i's tensors under ``models.<i>.`` (clients in
fusekit's canonical order) and the metadata key ``fusekit.ams``::

    {"format": "fusekit.ams/1", "mode": "full", "k": 10, "confidence": "class-share",
     "models": [{"prefix": "models.0.", "arch": {...} | null, "spec": {...},
                 "num_samples": 600 | null, "class_counts": [60, 0, ...] | null}, ...]}

``arch`` is the client's ``fusekit.arch`` (how :func:`fusekit.load_fused` rebuilds it) and
``spec`` its permutation spec JSON (the fallback for clients without ``arch``);
``class_counts`` its ``fusekit.class_counts`` (what the ``class-share`` rule weighs by);
``confidence`` is absent from artefacts written before it existed (read as ``logit``). The
selection itself runs in torch (:mod:`fusekit.toolkit.nn.ams`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import numpy as np

from fusekit.core import metadata as meta
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.errors import CheckpointError, IncompatibleModelsError, ParameterError
from fusekit.core.spec import PermutationSpec
from fusekit.core.transformer import TransformerSpec
from fusekit.methods.avg import class_counts_matrix
from fusekit.methods.base import FusionMethod, FusionResult, register
from fusekit.methods.params import Param

MODES = ("top1", "topk", "full")
#: How a model's confidence on an input is measured (ALGORITHMS.md §6): ``logit`` is the AMS
#: paper's max logit; ``probability`` the max softmax probability, which does not depend on
#: the scale of a model's logits; ``class-share`` each model's probability of class c
#: weighted by its share of class c's training samples (needs every model's class counts).
CONFIDENCES = ("logit", "probability", "class-share")
CLASS_SHARE = "class-share"


def check_confidence(confidence: str) -> str:
    """``confidence`` if it is one of :data:`CONFIDENCES`.

    Raises:
        ParameterError: any other value.
    """
    if confidence not in CONFIDENCES:
        raise ParameterError(
            f"confidence: expected one of {', '.join(CONFIDENCES)}, got {confidence!r}"
        )
    return confidence


def model_prefix(index: int) -> str:
    """Tensor-name prefix of sub-model ``index`` in an AMS artefact."""
    return f"models.{index}."


@register
class AdaptiveModelSelection(FusionMethod):
    name = "ams"
    summary = ("adaptive model selection: keep every client model, answer each input with "
               "the most confident one(s) (top1 | topk | full); any architectures")
    requires_same_architecture = False
    makes_one_network = False
    handles_groups = True
    handles_transformers = True

    def fuse(
        self,
        checkpoints: Sequence[Checkpoint],
        specs: Sequence[PermutationSpec],
        *,
        mode: Annotated[str | None, Param(
            help="top1 (the most confident model answers), topk (sum of the k most "
            "confident models' logits) or full (sum of all)",
            paper="AMS paper §5, Eq. 7-9", choices=MODES,
            default_text="full with confidence class-share, else top1",
        )] = None,
        k: Annotated[int | None, Param(
            help="models summed by mode topk, at most the number of clients", minimum=1,
            default_text="1 for top1, all for full",
        )] = None,
        confidence: Annotated[str | None, Param(
            help="how the models are weighed: logit (largest max logit, the paper's rule), "
            "probability (largest max softmax probability, one scale for every model) or "
            "class-share (each model's probability of class c weighted by its share of "
            "class c's training samples)", paper="AMS paper Eq. 8 (logit)",
            choices=CONFIDENCES,
            default_text="class-share when every client has class counts, else logit",
        )] = None,
    ) -> FusionResult:
        """Pack every client into one AMS artefact (AMS paper Algorithm 2).

        Args:
            checkpoints: the S clients, in canonical order (their index in the artefact is
                the tie-breaking order: on equal confidence the lower index wins).
            specs: each client's permutation spec; architectures may differ (depth, width,
                MLP or CNN) as long as every model has the same number of outputs.
            mode: ``top1`` (answer with the most confident model, AMS-top1), ``topk`` (sum
                the logits of the k most confident models) or ``full`` (sum all S logits,
                AMS-full). Default: ``full`` under ``class-share``, else ``top1``.
            k: number of models summed by ``topk``, 1 <= k <= S; implied by the other modes
                (1 for top1, S for full) and may only be given with them if it agrees.
            confidence: how the most confident models are chosen: ``logit`` (the largest
                max logit, AMS paper Eq. 8) or ``probability`` (the largest max softmax
                probability). ``logit`` lets a model with much larger logits than the others
                (a client trained on one class) win every input; ``probability`` compares
                models on one scale. ``class-share``: model s contributes
                f_sc softmax(z_s(x))_c to class c, f_sc = N_sc / sum_s' N_s'c (its share of
                class c's training samples), and the fused logits are the log of the sum
                over the chosen models (all, with ``full``; the k with the largest
                max_c f_sc p_sc(x) otherwise). Default: ``class-share`` when every client
                carries ``fusekit.class_counts``, else ``logit``.

        Returns:
            FusionResult whose state_dict holds ``models.<i>.<name>`` for every client
            tensor and whose metadata describes each sub-model (``fusekit.ams``);
            ``widths`` is empty (there is no single fused layer structure).

        Raises:
            ParameterError: unknown mode or confidence, k missing/out of range/contradicting
                the mode, or ``class-share`` with a client that has no class counts.
            IncompatibleModelsError: the models do not all have the same number of outputs,
                or do not all take the same inputs.
        """
        if any(isinstance(spec, TransformerSpec) for spec in specs):
            outputs = check_same_classifiers(checkpoints, specs)
        else:
            check_same_outputs(checkpoints, specs)
            check_same_inputs(checkpoints, specs)
            outputs = specs[0].out_features
        if confidence is None:
            confidence = CLASS_SHARE if all(c.class_counts is not None for c in checkpoints) \
                else "logit"
        if check_confidence(confidence) == CLASS_SHARE:
            class_counts_matrix(checkpoints, outputs)  # every client has them
        if mode is None:
            mode = "full" if confidence == CLASS_SHARE else "top1"
        k = resolve_k(mode, k, len(checkpoints))
        state_dict: dict[str, np.ndarray] = {}
        models = []
        for index, (checkpoint, spec) in enumerate(zip(checkpoints, specs, strict=True)):
            prefix = model_prefix(index)
            for name in checkpoint.tensors:
                state_dict[prefix + name] = checkpoint.tensor(name)
            counts = checkpoint.class_counts
            models.append({"prefix": prefix, "arch": checkpoint.arch, "spec": spec.to_json(),
                           "num_samples": checkpoint.num_samples,
                           "class_counts": None if counts is None else counts.tolist()})
            if checkpoint.config is not None:  # rebuilt by transformers from its config
                models[-1]["config"] = checkpoint.config
        description = {"format": meta.AMS_FORMAT, "mode": mode, "k": k,
                       "confidence": confidence, "models": models}
        report = {
            "models": len(models),
            "hidden_widths": [spec.hidden_widths for spec in specs],
            "parameters": int(sum(np.prod(a.shape) for a in state_dict.values())),
        }
        return FusionResult(
            state_dict=state_dict,
            method=self.name,
            params={"mode": mode, "k": k, "confidence": confidence},
            widths=[],
            report=report,
            metadata={meta.AMS: json.dumps(description)},
        )


def resolve_k(mode: str, k: int | None, n_models: int) -> int:
    """The number of models whose logits are summed: 1 (top1), k (topk), S (full).

    Raises:
        ParameterError: unknown mode; ``topk`` without k or with k outside 1..S; a k that
            contradicts ``top1``/``full``.
    """
    if mode not in MODES:
        raise ParameterError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer))):
        raise ParameterError(f"k: expected an integer, got {k!r}")
    implied = {"top1": 1, "full": n_models}.get(mode)
    if implied is not None:
        if k is not None and k != implied:
            raise ParameterError(
                f"k={k} contradicts mode {mode!r}, which sums {implied} model(s); use "
                "mode='topk' to choose k"
            )
        return implied
    if k is None:
        raise ParameterError("mode 'topk' needs k (--k): how many models' logits to sum")
    if not 1 <= k <= n_models:
        raise ParameterError(f"k: expected 1 <= k <= {n_models} (the number of models), got {k}")
    return int(k)


#: Hugging Face heads whose logits are (batch, classes), and the tensor holding their rows.
CLASSIFIER_HEADS = {"ForImageClassification": "classifier.weight",
                    "ForSequenceClassification": "classifier.weight"}


def check_same_classifiers(checkpoints: Sequence[Checkpoint], specs: Sequence[Any]) -> int:
    """AMS on transformers: every client a Hugging Face classifier (logits (batch, classes))
    of one model type, with the same number of classes; returns that number.

    Raises:
        IncompatibleModelsError: a client that is not a transformer classifier (an LM head
            answers per token, not per input), another model type, or other classes.
    """
    found = []
    for checkpoint, spec in zip(checkpoints, specs, strict=True):
        config = checkpoint.config or {}
        name = (config.get("architectures") or ["?"])[0]
        head = next((t for suffix, t in CLASSIFIER_HEADS.items() if name.endswith(suffix)),
                    None)
        if head is not None and head not in checkpoint.tensors:
            head = "score.weight" if "score.weight" in checkpoint.tensors else None
        if not isinstance(spec, TransformerSpec) or head is None:
            raise IncompatibleModelsError(
                f"{checkpoint.label}: AMS on transformers takes Hugging Face classifiers "
                f"(*ForSequenceClassification, *ForImageClassification); found {name}")
        found.append((checkpoint, config.get("model_type"), checkpoint.tensors[head].shape[0]))
    for checkpoint, family, classes in found[1:]:
        if (family, classes) != found[0][1:]:
            raise IncompatibleModelsError(
                f"{checkpoint.label} is a {family} with {classes} classes but "
                f"{found[0][0].label} is a {found[0][1]} with {found[0][2]}; AMS needs every "
                "model to answer the same inputs with the same classes")
    return found[0][2]


def check_same_outputs(checkpoints: Sequence[Checkpoint],
                       specs: Sequence[PermutationSpec]) -> None:
    """AMS compares logits across models: every model needs the same number of outputs."""
    first = specs[0].out_features
    for checkpoint, spec in zip(checkpoints, specs, strict=True):
        if spec.out_features != first:
            raise IncompatibleModelsError(
                f"{checkpoint.label} has {spec.out_features} outputs but "
                f"{checkpoints[0].label} has {first}; AMS needs every model to have the same "
                "number of outputs (classes)"
            )


def check_same_inputs(checkpoints: Sequence[Checkpoint],
                      specs: Sequence[PermutationSpec]) -> None:
    """Every model must answer the same inputs: the same number of input values per sample
    where it is known (an MLP's features; a convnet's C*H*W when its ``fusekit.arch`` gives
    the image size), and the same input channels between convnets."""
    sizes = [(c, _input_values(c, s)) for c, s in zip(checkpoints, specs, strict=True)]
    channels = [(c, s.in_features) for c, s in zip(checkpoints, specs, strict=True)
                if s.layers[0].kind == "conv2d"]
    for unit, known in (("input values per sample", [p for p in sizes if p[1] is not None]),
                        ("input channels", channels)):
        for checkpoint, value in known[1:]:
            if value != known[0][1]:
                raise IncompatibleModelsError(
                    f"{checkpoint.label} takes {value} {unit} but {known[0][0].label} takes "
                    f"{known[0][1]}; AMS needs every model to answer the same inputs"
                )


def _input_values(checkpoint: Checkpoint, spec: PermutationSpec) -> int | None:
    first = spec.layers[0]
    if first.kind == "linear":
        return first.in_features
    size = (checkpoint.arch or {}).get("image_size")
    if isinstance(size, list) and len(size) == 2 and all(type(v) is int for v in size):
        return first.in_features * size[0] * size[1]
    return None


def read_ams_metadata(metadata: Mapping[str, str], label: str) -> dict[str, Any]:
    """The ``fusekit.ams`` description of an AMS artefact, with its mode, k and confidence
    checked (``confidence`` filled in as ``logit`` when absent)."""
    description = meta.read_ams(metadata, label)
    description.setdefault("confidence", "logit")
    try:
        resolve_k(description.get("mode"), description.get("k"), len(description["models"]))
        check_confidence(description["confidence"])
    except ParameterError as exc:
        raise CheckpointError(f"{label}: metadata {meta.AMS}: {exc}") from None
    if description["confidence"] == CLASS_SHARE:
        ams_class_counts(description, label)
    return description


def ams_class_counts(description: Mapping[str, Any], label: str) -> np.ndarray | None:
    """(S, C) class counts of an AMS artefact's models, or None when any model lacks them.

    Raises:
        CheckpointError: counts that are not lists of non-negative numbers of one length, or
            missing counts under the ``class-share`` rule.
    """
    found = [m.get("class_counts") if isinstance(m, Mapping) else None
             for m in description["models"]]
    if any(c is None for c in found):
        if description.get("confidence") == CLASS_SHARE:
            raise CheckpointError(f"{label}: metadata {meta.AMS}: confidence {CLASS_SHARE!r} "
                                  "needs class_counts for every model")
        return None
    try:
        counts = np.asarray(found, dtype=np.float64)
    except (TypeError, ValueError):
        counts = np.empty(0)
    if counts.ndim != 2 or not (np.isfinite(counts).all() and (counts >= 0).all()):
        raise CheckpointError(f"{label}: metadata {meta.AMS}: class_counts: expected one "
                              "list of non-negative counts of the same length per model")
    return counts
