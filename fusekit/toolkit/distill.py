"""The student's training of ``--method distill`` (docs/ALGORITHMS.md §14), in torch.

Each step draws a fresh batch of inputs from the input prior (for MLPs by default random
combinations of the principal directions of the clients' first-layer weight rows,
:func:`weight_basis`; else a standard normal) and labels from the classes' prior, moves
the inputs ``input_steps`` Adam steps toward what the teacher answers with those labels
(fidelity) and what each input's expert (a client drawn by its share of the label's
samples) answers with it, where the student disagrees with it (DENSE's adversarial term) and, for
clients with BatchNorm, where every BatchNorm sees its running statistics (DeepInversion),
then updates the student with the temperature-softened KL to the teacher's answers (at
the teacher's temperature where their top class is the input's label) on the batch and,
beside it, ``replay`` times as many inputs drawn from a pool of the latest ``pool`` inputs
of earlier steps, the teacher's answers kept (learning from an input costs a
fraction of making it: the teacher runs every client forward and back for each input step).
Drawing every batch afresh keeps the synthetic set diverse: inputs optimised over many
steps drift to where every client is confident for no reason, and a student taught there
loses what its matched start knew (benchmarks/RESULTS.md, "Distillation"). The run stops
when the disagreement on the fresh batches, averaged over steps, has not reached a new low
for ``patience`` steps: a rule computed from the models alone.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fusekit.core import metadata as meta
from fusekit.core import progress
from fusekit.methods.distill import DistillationTask
from fusekit.toolkit.nn.fused import build_plain_model
from fusekit.toolkit.nn.hf import ClassifierLogits, model_from_tensors, saved_state_dict
from fusekit.toolkit.train import Optimizer, resolve_device

log = logging.getLogger(__name__)

#: Smoothing of the disagreement the stopping rule watches (an average over ~20 steps).
SMOOTHING = 0.05
#: The adversarial term is capped: past it, inputs only chase where the student is wrong
#: for reasons the teacher does not share (DENSE clips it the same way).
DISAGREEMENT_CAP = 5.0
#: The replay pool holds at most this many bytes of inputs and answers: ``pool`` inputs of
#: a 784-pixel model take 52 MB, of a 224 x 224 RGB one 9.9 GB.
POOL_BYTES = 1 << 30


def train_student(task: DistillationTask) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Distil the clients' ensemble into the initial fusion (no data; see the module).

    Args:
        task: the clients, the initial fusion and the settings (``fusekit.methods.distill``).

    Returns:
        The student's state_dict (the initial fusion's names and dtypes) and the report:
        teacher rule, steps run and why the run stopped, synthetic inputs used, and the
        disagreement (KL teacher || student, nats) and top-1 agreement at the start and end.
    """
    settings = task.settings
    device = resolve_device(settings["device"])
    teachers = [_frozen(_client_module(c, s), device)
                for c, s in zip(task.clients, task.specs, strict=True)]
    student = _student_module(task).to(device).eval()  # eval: BatchNorm keeps its statistics
    shares = (None if task.class_shares is None
              else torch.as_tensor(task.class_shares, dtype=torch.float32, device=device))
    teacher = Teacher(teachers, shares, settings["teacher_temperature"])
    trainer = _Trainer(teacher, student, task, device)
    with _cpu_threads(settings["threads"] if device.type == "cpu" else None):
        report = trainer.run()
    trained = saved_state_dict(student.model) if task.student.config else student.state_dict()
    state = {name: _like(trained[name], reference)
             for name, reference in task.student.state_dict.items()}
    return state, report


class Teacher:
    """The clients' ensemble: log of the class-share mixture sum_s f_sc softmax(z_s)_c (AMS's
    class-aware rule, ALGORITHMS §6) or of the softmax average, the same at ``temperature``
    for the student to learn, and, for clients with BatchNorm, DeepInversion's statistics
    loss of the last batch it answered."""

    def __init__(self, models: Sequence[nn.Module], shares: torch.Tensor | None,
                 temperature: float = 1.0):
        self.models = list(models)
        self.shares = shares
        self.temperature = temperature
        self.norms = [m for model in self.models for m in model.modules()
                      if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self.rule = "class-share" if shares is not None else "softmax"

    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        return self.answers(x)[0]

    def taught(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """What the student learns: the ensemble's log-probabilities, at the teacher's
        temperature (renormalised) on the inputs whose top class is the label they were
        made for (every input without labels), as they are on the others: sharpened where
        the ensemble is unsure, the student would learn its guesses."""
        answers = self.log_probs(x)
        sharpened = (answers / self.temperature).log_softmax(dim=1)
        if labels is None:
            return sharpened
        made = (answers.argmax(dim=1) == labels)[:, None]
        return torch.where(made, sharpened, answers.log_softmax(dim=1))

    def answers(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ensemble's log-probabilities (B, C) and every client's (S, B, C)."""
        client_log_probs = torch.stack([model(x) for model in self.models]).float().log_softmax(
            dim=2)
        return self._mixture(client_log_probs.exp()), client_log_probs

    def _mixture(self, probs: torch.Tensor) -> torch.Tensor:
        mixture = ((self.shares[:, None, :] * probs).sum(dim=0) if self.shares is not None
                   else probs.mean(dim=0))
        # normalised: the class-share mixture sums to one only when every f_sc does
        return mixture.clamp_min(torch.finfo(mixture.dtype).tiny).log().log_softmax(dim=1)

    @contextmanager
    def batchnorm_loss(self) -> Iterator[list[torch.Tensor]]:
        """Collect, per BatchNorm run inside the block, || mean - running mean || + || var -
        running var || of its input batch (DeepInversion Eq. 4)."""
        losses: list[torch.Tensor] = []

        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], _out: Any) -> None:
            x = inputs[0]
            dims = [d for d in range(x.dim()) if d != 1]
            losses.append(torch.linalg.vector_norm(x.mean(dims) - module.running_mean)
                          + torch.linalg.vector_norm(x.var(dims, unbiased=False)
                                                     - module.running_var))

        handles = [norm.register_forward_hook(hook) for norm in self.norms]
        try:
            yield losses
        finally:
            for handle in handles:
                handle.remove()


class _Trainer:
    def __init__(self, teacher: Teacher, student: nn.Module, task: DistillationTask,
                 device: torch.device):
        self.teacher, self.student, self.task, self.device = teacher, student, task, device
        s = task.settings
        self.settings = s
        self.generator = torch.Generator(device=device).manual_seed(s["seed"])
        self.prior = torch.as_tensor(task.class_prior, dtype=torch.float32, device=device)
        self.optimizer = Optimizer(student.parameters(), "adam", s["lr"])
        self.start = [p.detach().clone() for p in student.parameters()]
        self.basis = _input_basis(task, device)
        #: a language model's inputs are token sequences sampled from the teacher
        self.tokens = (task.clients[0].config or {}).get("model_type") == "gpt2"
        #: pool inputs per fresh input in each student update; none for a language model,
        #: whose answers (a vocabulary per token) are too large to keep and would cost the
        #: teacher's forward pass again
        self.replay = 0 if self.tokens else s["replay"]
        self.pool = _Pool(_pool_capacity(s, task.input_shape, len(self.prior)))
        #: (C, S): for each label, the odds of each client being the expert that its input
        #: is moved to convince: its share of the class (uniform without class counts)
        self.expert_odds = (torch.ones(len(self.prior), len(task.clients), device=device)
                            if task.class_shares is None else torch.as_tensor(
                                task.class_shares.T, dtype=torch.float32, device=device
                            ).clamp_min(1e-12))
        self.input_range = None if task.input_range is None else tuple(
            torch.as_tensor(bound, dtype=torch.float32, device=device).view(1, -1, 1, 1)
            for bound in task.input_range)

    def run(self) -> dict[str, Any]:
        s = self.settings
        smoothed, best, since, stopped = math.nan, math.inf, 0, "steps"
        first = last = None
        step = 0
        for step in range(1, s["steps"] + 1):
            x, labels = self._synthetic_batch()
            with torch.no_grad():
                target = self.teacher.taught(x, labels)
            measured = self._student_step(x, target, self._replayed())
            if self.replay:
                self.pool.add(x, target)
            first = first or measured
            last = measured
            kl = measured["disagreement"]
            smoothed = kl if math.isnan(smoothed) else smoothed + SMOOTHING * (kl - smoothed)
            if smoothed < best * (1 - 1e-3):
                best, since = smoothed, 0
            else:
                since += 1
            progress.advance("distillation steps", step, s["steps"])
            log.debug("distill: step %d, disagreement %.4f (smoothed %.4f), agreement %.3f",
                      step, kl, smoothed, measured["agreement"])
            if s["patience"] and since >= s["patience"]:
                stopped = "patience"
                break
        log.info("distill: %d steps (%s), disagreement with the %s ensemble %.4f -> %.4f",
                 step, "stopping rule" if stopped == "patience" else "all steps",
                 self.teacher.rule, first["disagreement"], last["disagreement"])
        return {"teacher": self.teacher.rule, "steps": step, "stopped": stopped,
                "synthetic_inputs": step * s["batch"], "data": "none",
                "replayed_inputs": (step - 1) * self.replay * s["batch"],
                "pool": self.pool.capacity if self.replay else 0,
                "prior": ("sampled from the teacher" if self.tokens
                          else "normal" if self.basis is None else self.settings["prior"]),
                "pixel_range": (None if self.task.input_range is None
                                else [b.tolist() for b in self.task.input_range]),
                "batchnorm_layers": len(self.teacher.norms),
                "input_shape": list(self.task.input_shape), "device": str(self.device),
                "start": first, "end": last, "smoothed_disagreement": smoothed}

    def _synthetic_batch(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fresh inputs from the prior, moved toward confident, disputed, BatchNorm-like
        ones, and the labels they were made for (token sequences: None)."""
        s = self.settings
        if self.tokens:
            return self._sampled_sequences(), None
        labels = torch.multinomial(self.prior, s["batch"], replacement=True,
                                   generator=self.generator)
        experts = torch.multinomial(self.expert_odds[labels], 1,
                                    generator=self.generator).squeeze(1)
        if self.basis is None:
            x = torch.randn((s["batch"], *self.task.input_shape), generator=self.generator,
                            device=self.device)
        else:
            z = torch.randn((s["batch"], len(self.basis)), generator=self.generator,
                            device=self.device)
            x = (z @ self.basis).view(s["batch"], *self.task.input_shape)
        self._keep_in_range(x)
        x.requires_grad_(True)
        optimizer = Optimizer([x], "adam", s["input_lr"])
        for _ in range(s["input_steps"]):
            with self.teacher.batchnorm_loss() as norms:
                target, clients = self.teacher.answers(x)
            disagreement = _kl(target, self.student(x))
            expert = -clients[experts, torch.arange(len(labels), device=self.device), labels]
            loss = (F.nll_loss(target, labels) + s["experts"] * expert.mean()
                    - s["adversarial"] * disagreement.clamp(max=DISAGREEMENT_CAP))
            if norms and s["batchnorm"]:
                loss = loss + s["batchnorm"] * torch.stack(norms).sum() / len(
                    self.teacher.models)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            self._keep_in_range(x)
        return x.detach(), labels

    @torch.no_grad()
    def _keep_in_range(self, x: torch.Tensor) -> None:
        """Pixels clamped, channel by channel, to what the image processor can give."""
        if self.input_range is not None:
            torch.maximum(x, self.input_range[0], out=x)
            torch.minimum(x, self.input_range[1], out=x)

    @torch.no_grad()
    def _sampled_sequences(self) -> torch.Tensor:
        """Token sequences sampled a token at a time from the teacher mixed with the uniform
        distribution (weight ``exploration``), the first uniformly (nothing in the models
        says how a sequence starts)."""
        batch, length = self.settings["batch"], self.task.input_shape[0]
        uniform = self.settings["exploration"]
        vocabulary = len(self.prior)
        x = torch.empty((batch, length), dtype=torch.long, device=self.device)
        x[:, 0] = torch.randint(vocabulary, (batch,), generator=self.generator,
                                device=self.device)
        for t in range(1, length):
            last = self.teacher.log_probs(x[:, :t]).view(batch, t, vocabulary)[:, -1]
            probs = (1 - uniform) * last.exp() + uniform / vocabulary
            x[:, t] = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        return x

    def _replayed(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``replay`` pool inputs per fresh one, drawn from the pool with the teacher's
        answers to them (None before the pool holds any, or without replay)."""
        if not self.replay or not self.pool.filled:
            return None
        return self.pool.draw(self.replay * self.settings["batch"], self.generator)

    def _student_step(self, x: torch.Tensor, target: torch.Tensor,
                      replayed: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> dict[str, float]:
        """One KL step of the student toward the teacher's log-probabilities ``target`` on
        ``x`` and on the ``replayed`` pool inputs beside it; the disagreement and agreement
        it had on ``x``."""
        s = self.settings
        tau = s["temperature"]
        fresh = len(target)  # a language model's answers are per token
        if replayed is not None:
            x, target = torch.cat([x, replayed[0]]), torch.cat([target, replayed[1]])
        logits = self.student(x)
        loss = _kl(target / tau, logits / tau) * tau * tau
        if s["proximal"]:
            loss = loss + s["proximal"] * sum(((p - p0) ** 2).sum() for p, p0 in
                                            zip(self.student.parameters(), self.start,
                                                strict=True))
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        with torch.no_grad():
            logits, target = logits[:fresh], target[:fresh]
            return {"disagreement": float(_kl(target, logits)),
                    "agreement": float((logits.argmax(1) == target.argmax(1)).float().mean())}


def weight_basis(first_layers: Sequence[np.ndarray], principal: bool = False) -> torch.Tensor:
    """The ``weights`` prior's rows: every client's first-layer weight rows (out, in),
    centred and scaled so that x = z @ rows, z ~ N(0, I), has unit variance per input on
    average, the scale of normalised inputs; with ``principal`` (the ``principal`` prior)
    only their principal directions that stand above their random part, each scaled by its
    singular value.

    Trained from independent initialisations, the rows share little but the directions
    training moved them in, the data's: inputs drawn in their span vary where the data
    varies and hardly where it is constant, unlike N(0, I) noise, on which the clients
    agree with the student from the start (ALGORITHMS §14). The random initialisations
    spread the rest of their length over every direction alike (the MNIST-format digits'
    784-100-10 clients: 46 % of it outside the data's 64 dimensions); ``principal`` drops
    the singular values below Gavish and Donoho's hard threshold for noise of unknown
    level, so the inputs vary only where training moved the weights.
    """
    rows = torch.from_numpy(np.concatenate([np.asarray(w, dtype=np.float32)
                                            for w in first_layers]))
    rows = rows - rows.mean(dim=0)
    if principal:
        _, values, directions = torch.linalg.svd(rows, full_matrices=False)
        keep = values > noise_threshold(values, rows.shape)
        rows = values[keep, None] * directions[keep] if keep.any() else rows
    return rows / rows.pow(2).sum(dim=0).mean().sqrt().clamp_min(torch.finfo(rows.dtype).tiny)


def noise_threshold(values: torch.Tensor, shape: Sequence[int]) -> float:
    """Gavish and Donoho's optimal hard threshold for the singular values of an m x n
    matrix whose noise level is unknown: omega(beta) times their median, beta = min/max
    of its sides (IEEE Trans. Inf. Theory 60(8), 2014, Eq. 5's approximation of omega)."""
    beta = min(shape) / max(shape)
    omega = 0.56 * beta**3 - 0.95 * beta**2 + 1.82 * beta + 1.43
    return omega * float(values.median())


def _input_basis(task: DistillationTask, device: torch.device) -> torch.Tensor | None:
    """:func:`weight_basis` of MLP clients with the ``weights`` or ``principal`` prior, else
    None (N(0, I); a convolutional model's first weights are filters, not inputs)."""
    if task.settings["prior"] == "normal" or task.clients[0].config is not None:
        return None
    first = [c.tensor(spec.layers[0].weight) for c, spec in zip(task.clients, task.specs,
                                                                   strict=True)]
    if first[0].ndim != 2:
        return None
    return weight_basis(first, principal=task.settings["prior"] == "principal").to(device)


def _pool_capacity(settings: dict[str, Any], input_shape: Sequence[int], classes: int) -> int:
    """``pool`` inputs, or fewer where they and their answers would pass
    :data:`POOL_BYTES`, never fewer than a batch."""
    each = 4 * (math.prod(input_shape) + classes)
    return min(settings["pool"], max(settings["batch"], POOL_BYTES // each))


class _Pool:
    """The latest ``capacity`` synthetic inputs and the teacher's answers to them, which
    student updates draw from uniformly, with replacement."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.inputs: torch.Tensor | None = None
        self.targets: torch.Tensor | None = None
        self.size = self.next = 0

    @property
    def filled(self) -> bool:
        return self.size > 0

    def add(self, x: torch.Tensor, target: torch.Tensor) -> None:
        """Keep ``x`` and ``target``, overwriting the oldest; of a batch larger than the
        pool, its last inputs."""
        x, target = x[-self.capacity:], target[-self.capacity:]
        if self.inputs is None or self.targets is None:
            self.inputs = x.new_empty((self.capacity, *x.shape[1:]))
            self.targets = target.new_empty((self.capacity, *target.shape[1:]))
        places = (self.next + torch.arange(len(x), device=x.device)) % self.capacity
        self.inputs[places] = x
        self.targets[places] = target
        self.next = (self.next + len(x)) % self.capacity
        self.size = min(self.size + len(x), self.capacity)

    def draw(self, count: int, generator: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` inputs drawn with replacement, and the teacher's answers to them."""
        assert self.inputs is not None and self.targets is not None
        picks = torch.randint(self.size, (count,), generator=generator,
                              device=self.inputs.device)
        return self.inputs[picks], self.targets[picks]


@contextmanager
def _cpu_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` for the block (None: unchanged)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _kl(target_log_probs: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per sample, averaged; the teacher's scores are renormalised
    (a temperature divides log-probabilities, which then no longer sum to one)."""
    return F.kl_div(F.log_softmax(student_logits, dim=1), F.log_softmax(target_log_probs, dim=1),
                    reduction="batchmean", log_target=True)


def _client_module(checkpoint: Any, spec: Any) -> nn.Module:
    if checkpoint.config is not None:
        return ClassifierLogits(model_from_tensors(checkpoint.config, checkpoint.state_dict(),
                                                   checkpoint.label))
    spec_json = spec.to_json() if checkpoint.arch is None else None
    return build_plain_model(checkpoint.state_dict(), checkpoint.arch, spec_json,
                             checkpoint.label)


def _student_module(task: DistillationTask) -> nn.Module:
    result = task.student
    if result.config is not None:
        return ClassifierLogits(model_from_tensors(
            result.config, result.state_dict, f"the initial {result.method} fusion"))
    arch = result.metadata.get(meta.ARCH)
    return build_plain_model(result.state_dict, json.loads(arch) if arch else None,
                             result.spec.to_json(), f"the initial {result.method} fusion")


def _frozen(model: nn.Module, device: torch.device) -> nn.Module:
    return model.to(device).eval().requires_grad_(False)


def _like(value: torch.Tensor, reference: np.ndarray) -> np.ndarray:
    """The student's tensor as numpy in the initial fusion's dtype (counters untouched)."""
    array = value.detach().cpu().numpy()
    return np.asarray(reference) if array.dtype.kind in "iu" else array.astype(
        np.asarray(reference).dtype, copy=False)
