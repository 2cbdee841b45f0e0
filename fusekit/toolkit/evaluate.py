"""Accuracy and loss of client and fused models, and the ensemble baseline.

Inference only (``torch.inference_mode``); the test set is moved to the device once and
sliced there. Two ensemble baselines combine the client models (any mix of architectures
with the same number of classes): ``ensemble`` averages their logits, ``ensemble-softmax``
their softmax probabilities (the stronger data-free combiner under non-iid clients: a
client with large logits cannot outvote the others).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fusekit.core import progress
from fusekit.core.checkpoint import Checkpoint, load_checkpoint
from fusekit.core.errors import DataError
from fusekit.core.metadata import METHOD
from fusekit.toolkit.data import Dataset
from fusekit.toolkit.nn.modules import load_model
from fusekit.toolkit.train import resolve_device

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 4096
ENSEMBLE = "ensemble"
SOFTMAX_ENSEMBLE = "ensemble-softmax"


@dataclass
class Score:
    """Accuracy (fraction correct) and mean cross-entropy loss of one model."""

    name: str
    kind: str  # "client", "fused" or "ensemble"
    accuracy: float
    loss: float
    samples: int
    method: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EvaluationReport:
    """Scores of every model, in input order, then the logit and softmax ensembles (when
    there are >= 2 client models)."""

    data: str
    device: str
    scores: list[Score] = field(default_factory=list)

    @property
    def clients(self) -> list[Score]:
        return [s for s in self.scores if s.kind == "client"]

    @property
    def mean_client_accuracy(self) -> float | None:
        clients = self.clients
        return float(np.mean([s.accuracy for s in clients])) if clients else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "data": self.data,
            "device": self.device,
            "mean_client_accuracy": self.mean_client_accuracy,
            "scores": [s.as_dict() for s in self.scores],
        }


def load_for_evaluation(
    checkpoint_or_path: Checkpoint | str | os.PathLike[str], device: str | torch.device = "cpu"
) -> nn.Module:
    """The one place that turns a checkpoint into a module for evaluation.

    Uses ``fusekit.load_fused`` when the package provides it (it rebuilds every method's
    output, AMS artefacts included, and clients without ``fusekit.arch``); otherwise
    :func:`fusekit.toolkit.nn.load_model`, which needs ``fusekit.arch``.

    Raises:
        CheckpointError: the file cannot be turned into a model.
    """
    ckpt = (
        checkpoint_or_path
        if isinstance(checkpoint_or_path, Checkpoint)
        else load_checkpoint(checkpoint_or_path)
    )
    import fusekit

    load_fused = getattr(fusekit, "load_fused", None)
    if load_fused is not None:
        return load_fused(ckpt, str(device)).eval()
    return load_model(ckpt, device)


def predict_logits(
    model: nn.Module, inputs: torch.Tensor, *, batch_size: int = DEFAULT_BATCH_SIZE
) -> torch.Tensor:
    """Logits (N, K) of ``model`` on ``inputs`` (already on the model's device)."""
    model.eval()
    with torch.inference_mode():
        return torch.cat(
            [model(inputs[i : i + batch_size]) for i in range(0, len(inputs), batch_size)]
        )


def score_logits(
    logits: torch.Tensor, targets: torch.Tensor, name: str, kind: str, method: str | None = None
) -> Score:
    """Accuracy and mean cross-entropy of (N, K) logits against (N,) integer targets."""
    with torch.inference_mode():
        loss = torch.nn.functional.cross_entropy(logits.float(), targets).item()
        accuracy = (logits.argmax(dim=1) == targets).double().mean().item()
    return Score(name, kind, float(accuracy), float(loss), len(targets), method)


class Evaluator:
    """The test split of a data set, moved to a device once, scoring models against it.

    Args:
        dataset: provides x_test (N, ...) float32 and y_test (N,) int64.
        device: ``auto`` (cuda when available), ``cpu`` or ``cuda``.
        batch_size: inference batch size.
    """

    def __init__(
        self, dataset: Dataset, device: str = "auto", batch_size: int = DEFAULT_BATCH_SIZE
    ):
        self.dataset = dataset
        self.device = resolve_device(device)
        self.batch_size = batch_size
        self.inputs = torch.as_tensor(dataset.x_test).to(self.device)
        self.targets = torch.as_tensor(dataset.y_test).to(self.device)

    def logits(
        self, checkpoint: Checkpoint | str | os.PathLike[str]
    ) -> tuple[Checkpoint, torch.Tensor]:
        """Load a checkpoint's model and return it with its (N, K) test logits.

        Raises:
            CheckpointError: the checkpoint cannot be turned into a model.
            DataError: the model's output size is not the data set's number of classes.
        """
        ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else load_checkpoint(checkpoint)
        model = load_for_evaluation(ckpt, self.device)
        logits = predict_logits(model, self.inputs, batch_size=self.batch_size)
        if logits.ndim != 2 or logits.shape[1] != self.dataset.num_classes:
            raise DataError(
                f"{ckpt.label}: model gives outputs of shape {tuple(logits.shape[1:])}; data set "
                f"{self.dataset.name} has {self.dataset.num_classes} classes"
            )
        return ckpt, logits

    def score(self, logits: torch.Tensor, name: str, kind: str, method: str | None = None) -> Score:
        return score_logits(logits, self.targets, name, kind, method)

    def ensemble(self, client_logits: Sequence[torch.Tensor]) -> Score:
        """The logit-average ensemble of client models (the AMS papers' baseline)."""
        return self.score(torch.stack(list(client_logits)).mean(dim=0), ENSEMBLE, ENSEMBLE)

    def softmax_ensemble(self, client_logits: Sequence[torch.Tensor]) -> Score:
        """The softmax-average ensemble: accuracy of the mean class probabilities, loss the
        cross-entropy of that mixture (scored as the log of the mean probabilities)."""
        return self.score(softmax_average(client_logits), SOFTMAX_ENSEMBLE, ENSEMBLE)


def softmax_average(client_logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """log(mean_s softmax(logits_s)), (N, K): logits whose softmax is the mean probability."""
    stacked = torch.stack([z.float() for z in client_logits])
    return torch.logsumexp(stacked.log_softmax(dim=2), dim=0) - np.log(len(client_logits))


def evaluate_checkpoints(
    checkpoints: Sequence[Checkpoint | str | os.PathLike[str]],
    dataset: Dataset,
    *,
    device: str = "auto",
    ensemble: bool = True,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> EvaluationReport:
    """Evaluate client and fused checkpoints on ``dataset``'s test split.

    Args:
        checkpoints: paths or Checkpoint objects; those without ``fusekit.method`` are
            client models, the others fused models (any mix of architectures).
        dataset: provides x_test (N, ...) float32 and y_test (N,) int64.
        device: ``auto`` (cuda when available), ``cpu`` or ``cuda``.
        ensemble: add the logit-average and softmax-average ensembles of the client
            models (needs >= 2).
        batch_size: inference batch size.

    Returns:
        An :class:`EvaluationReport`: one score per input in order, then the two ensembles.

    Raises:
        CheckpointError: a checkpoint cannot be loaded as a model.
        DataError: a model's output size differs from the data set's number of classes.
    """
    evaluator = Evaluator(dataset, device, batch_size)
    report = EvaluationReport(data=dataset.name, device=str(evaluator.device))
    client_logits = []
    names = distinct_names([item.path if isinstance(item, Checkpoint) else Path(item)
                            for item in checkpoints])
    for done, (item, name) in enumerate(zip(checkpoints, names, strict=True), 1):
        ckpt, logits = evaluator.logits(item)
        method = ckpt.metadata.get(METHOD)
        kind = "fused" if method else "client"
        report.scores.append(evaluator.score(logits, name, kind, method))
        if kind == "client":
            client_logits.append(logits)
        progress.advance("models scored", done, len(checkpoints))
    if ensemble and len(client_logits) >= 2:
        report.scores.append(evaluator.ensemble(client_logits))
        report.scores.append(evaluator.softmax_ensemble(client_logits))
    return report


def distinct_names(paths: Sequence[Path | None]) -> list[str]:
    """Each path's shortest trailing part that no other path ends with (``pfnm/fused.safetensors``
    beside ``nafi/fused.safetensors``, ``a.safetensors`` alone); ``model i`` without a path."""
    parts = [p.parts if p is not None else None for p in paths]

    def shortest(i: int) -> str:
        own = parts[i]
        for k in range(1, len(own)):
            if not any(other is not None and j != i and other[-k:] == own[-k:]
                       for j, other in enumerate(parts)):
                return str(Path(*own[-k:]))
        return str(paths[i])

    return [shortest(i) if p is not None else f"model {i}" for i, p in enumerate(parts)]

