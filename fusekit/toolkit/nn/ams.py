"""The AMS module: every client model, run on the same batch, answering per sample with the
most confident one(s) (ALGORITHMS.md §6; AMS paper §5, Eq. 7-9, Algorithm 2).

All sub-models run on the same batch on the same device, one by one. On request,
sub-models with the same architecture (same module class and tensor shapes) run as one
vectorised call (``torch.func.vmap`` over their stacked weights); that measured slower on
both the CPU and an H100 (benchmarks/RESULTS.md), so it is off by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from fusekit.core.errors import ParameterError
from fusekit.methods.ams import CLASS_SHARE, CONFIDENCES, MODES, check_confidence, resolve_k
from fusekit.methods.avg import shares_of_counts


def answers(logits: torch.Tensor, confidence: str = "logit",
            shares: torch.Tensor | None = None) -> torch.Tensor:
    """(S, B, C) what each model adds to the fused answer: its logits, or, under
    ``class-share``, f_sc softmax(logits[s, b])_c (``shares`` (S, C) holds f_sc)."""
    if check_confidence(confidence) != CLASS_SHARE:
        return logits
    if shares is None or shares.shape != (logits.shape[0], logits.shape[2]):
        raise ParameterError(
            f"confidence {CLASS_SHARE!r}: expected class shares of shape "
            f"{(logits.shape[0], logits.shape[2])} (models, classes), found "
            f"{None if shares is None else tuple(shares.shape)}")
    return shares.to(logits.device, torch.float32)[:, None, :] * logits.float().softmax(dim=2)


def confidences(logits: torch.Tensor, confidence: str = "logit",
                shares: torch.Tensor | None = None) -> torch.Tensor:
    """(S, B) confidence of each model on each sample: max_c logits[s, b, c] (``logit``,
    AMS paper Eq. 8), max_c softmax(logits[s, b])_c (``probability``) or
    max_c f_sc softmax(logits[s, b])_c (``class-share``)."""
    if check_confidence(confidence) == "probability":
        return logits.float().softmax(dim=2).amax(dim=2)
    return answers(logits, confidence, shares).amax(dim=2)


def select_logits(
    logits: torch.Tensor, k: int, confidence: str = "logit",
    shares: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the answers of the k models with the largest confidence, per sample.

    Confidence of model s on sample b is max_c logits[s, b, c] (``logit``, the AMS paper's
    absolute confidence, Eq. 8), its max softmax probability (``probability``) or its max
    class-share-weighted probability (``class-share``); the k most confident models are
    chosen per sample (Eq. 9 for k = 1). Their logits are summed, or under ``class-share``
    their weighted probabilities f_sc p_sc, whose log is returned (so that a softmax of the
    fused logits is the normalised mixture). Ties are broken by the lower model index (a
    stable descending sort), so the choice is deterministic on every device.

    Args:
        logits: (S, B, C) float tensor, logits of S models on B samples.
        k: number of models summed, 1 <= k <= S (k = S is AMS-full: the plain logit sum, or
            the whole class-share mixture).
        confidence: ``logit``, ``probability`` or ``class-share`` (see :func:`confidences`).
        shares: (S, C) class shares f_sc, needed by ``class-share`` only.

    Returns:
        (fused, chosen): fused (B, C) logits and chosen (k, B) int64 model indices, most
        confident first.

    Raises:
        ParameterError: logits not 3-D, k outside 1..S, an unknown confidence, or
            ``class-share`` without shares of shape (S, C).
    """
    if logits.dim() != 3:
        raise ParameterError(
            f"logits: expected shape (models, batch, classes), got {tuple(logits.shape)}"
        )
    n_models, batch, classes = logits.shape
    if not 1 <= k <= n_models:
        raise ParameterError(f"k: expected 1 <= k <= {n_models} (the number of models), got {k}")
    values = answers(logits, confidence, shares)
    if k == n_models:
        chosen = torch.arange(n_models, device=logits.device)[:, None].expand(n_models, batch)
        return _fused(values.sum(dim=0), confidence), chosen
    # Under class-share the confidence is the largest answer: reuse the answers computed.
    scores = values.amax(dim=2) if confidence == CLASS_SHARE else confidences(logits, confidence)
    if k == 1:
        # argmax returns the first maximal index: the lower model index wins ties.
        chosen = scores.argmax(dim=0, keepdim=True)
    else:
        chosen = torch.sort(scores, dim=0, descending=True, stable=True).indices[:k]
    picked = values.gather(0, chosen[:, :, None].expand(k, batch, classes))
    return _fused(picked.sum(dim=0), confidence), chosen


def _fused(summed: torch.Tensor, confidence: str) -> torch.Tensor:
    """Logits of the summed answers: the sum itself, or the log of a class-share mixture
    (the smallest positive float keeps a class no chosen model gives mass finite)."""
    if confidence != CLASS_SHARE:
        return summed
    return summed.clamp_min(torch.finfo(summed.dtype).tiny).log()


class AMSModel(nn.Module):
    """Adaptive model selection over sub-models that map the same inputs to C logits.

    Attributes:
        models: the sub-models (``models.<i>`` in the state_dict, as in the artefact).
        mode: ``top1``, ``topk`` or ``full``; ``k``: models summed; ``confidence``:
            ``logit``, ``probability`` or ``class-share`` (see :func:`select_logits`). All
            three can be changed after loading with :meth:`set_mode`.
        shares: (S, C) class shares f_sc from the models' class counts (a buffer outside
            the state_dict), or None when the counts are not known.
        vectorise: run sub-models of the same architecture as one vmap call (default
            off). Ten 784-100-10 MLPs at batch 1024 answered 0.66M samples/s vectorised
            against 0.87M one by one on an H100, and 0.24M against 0.28M on the CPU
            (benchmarks/RESULTS.md): stacking the weights on every call costs more than the
            batched kernels save. The results are the same either way.
    """

    def __init__(self, models: Sequence[nn.Module], mode: str = "top1", k: int | None = None,
                 confidence: str = "logit", class_counts=None):
        super().__init__()
        if not models:
            raise ParameterError("models: expected at least one sub-model, got none")
        self.models = nn.ModuleList(models)
        shares = None if class_counts is None else torch.from_numpy(
            shares_of_counts(class_counts)).float()
        self.register_buffer("shares", shares, persistent=False)
        self.mode, self.k = mode, resolve_k(mode, k, len(models))
        self.confidence = self._checked(confidence)
        self._groups = _same_architecture_groups(self.models)
        self.vectorise = False

    def _checked(self, confidence: str) -> str:
        if check_confidence(confidence) == CLASS_SHARE and self.shares is None:
            raise ParameterError(f"confidence {CLASS_SHARE!r} needs every model's class "
                                 "counts; this AMS model has none")
        return confidence

    def set_mode(self, mode: str, k: int | None = None,
                 confidence: str | None = None) -> AMSModel:
        """Switch between top1 / topk / full (and the confidence rule) without reloading;
        returns self."""
        self.mode, self.k = mode, resolve_k(mode, k, len(self.models))
        if confidence is not None:
            self.confidence = self._checked(confidence)
        return self

    def all_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of every sub-model on ``x``: (S, B, C)."""
        out: list[torch.Tensor | None] = [None] * len(self.models)
        for group in self._groups:
            # vmap cannot update BatchNorm running statistics in place: train mode runs the
            # models one by one.
            if len(group) == 1 or self.training or not self.vectorise:
                for index in group:
                    out[index] = self.models[index](x)
                continue
            members = [self.models[i] for i in group]
            params, buffers = stack_module_state(members)
            template = members[0]

            def run(p, b, inputs, template=template):
                return functional_call(template, (p, b), (inputs,))

            stacked = vmap(run, in_dims=(0, 0, None))(params, buffers, x)
            for row, index in enumerate(group):
                out[index] = stacked[row]
        return torch.stack(out)  # type: ignore[arg-type]

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fused logits (B, C), chosen model indices (k, B)) for inputs ``x``."""
        return select_logits(self.all_logits(x), self.k, self.confidence, self.shares)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.select(x)[0]

    def extra_repr(self) -> str:
        return (f"mode={self.mode}, k={self.k}, confidence={self.confidence}, "
                f"models={len(self.models)}")


def _same_architecture_groups(models: nn.ModuleList) -> list[list[int]]:
    """Indices of sub-models that can share one vectorised call: same class, same module
    structure (repr) and the same tensors with the same shapes and dtypes."""
    groups: dict[tuple, list[int]] = {}
    for index, model in enumerate(models):
        signature = (type(model), tuple(
            (name, tuple(t.shape), t.dtype) for name, t in model.state_dict().items()
        ), repr(model))
        groups.setdefault(signature, []).append(index)
    return list(groups.values())


__all__ = ["CONFIDENCES", "MODES", "AMSModel", "answers", "confidences", "select_logits"]
