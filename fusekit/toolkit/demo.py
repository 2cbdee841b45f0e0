"""The main job: simulate clients, fuse them with every registered method, evaluate.

Exactly what a user does with ``fusekit simulate``, ``fusekit fuse`` and ``fusekit
evaluate``, in one call: client checkpoints and fused models are real safetensors files
(in a temporary folder unless ``out_dir`` is given) and every model is loaded back from
its file for evaluation.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from fusekit.core import progress
from fusekit.core.errors import UnknownMethodError
from fusekit.toolkit.data import load_dataset
from fusekit.toolkit.evaluate import Evaluator, Score
from fusekit.toolkit.simulate import SimulationConfig, simulate_clients
from fusekit.toolkit.train import TrainConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoConfig:
    """Settings of the demo (defaults: the README's main job).

    Attributes:
        data: data set name (``digits`` needs no files).
        clients, partition, alpha, arch, epochs, lr, seed: simulation settings (Adam,
            batch 32; 20 epochs at 3e-3 bring digits clients close to zero training loss).
        methods: fusion methods to run; None = every method in ``fusekit.METHODS``.
        device: ``auto``, ``cpu`` or ``cuda`` for training and evaluation.
        batchnorm: MLP clients with BatchNorm after each hidden layer.
        calibrate: also calibrate each fused model with the clients' statistics of their
            own training data, layer by layer (ALGORITHMS §12), and score it.
        align: also calibrate each fused model, run one alignment round and a refit round
            per layer with the clients' data (``align_locally``), and score it.
    """

    data: str = "digits"
    clients: int = 8
    partition: str = "dirichlet"
    alpha: float = 0.5
    arch: str = "mlp:100"
    epochs: int = 20
    lr: float = 3e-3
    seed: int = 0
    methods: Sequence[str] | None = None
    device: str = "auto"
    batchnorm: bool = False
    calibrate: bool = False
    align: bool = False

    def simulation(self) -> SimulationConfig:
        return SimulationConfig(
            clients=self.clients,
            partition=self.partition,
            alpha=self.alpha,
            arch=self.arch,
            batchnorm=self.batchnorm,
            seed=self.seed,
            train=TrainConfig(epochs=self.epochs, batch_size=32, lr=self.lr, optimizer="adam"),
        )


@dataclass
class MethodRun:
    """One fusion method's outcome: its score, fusion time and fused widths (and, with
    calibration or alignment, the calibrated or aligned and refit model's score), or the
    error that stopped it."""

    method: str
    fuse_time_s: float | None = None
    widths: list[int] | None = None
    score: Score | None = None
    error: str | None = None
    calibrated: Score | None = None
    aligned: Score | None = None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("score", "calibrated", "aligned"):
            score = getattr(self, name)
            out[name] = score.as_dict() if score else None
        return out


@dataclass
class DemoReport:
    """Everything the demo's table shows."""

    config: DemoConfig
    device: str
    clients: list[Score] = field(default_factory=list)
    ensemble: Score | None = None
    methods: list[MethodRun] = field(default_factory=list)
    simulate_time_s: float = 0.0
    out_dir: str | None = None

    @property
    def mean_client_accuracy(self) -> float:
        return sum(s.accuracy for s in self.clients) / len(self.clients)

    @property
    def failed(self) -> list[MethodRun]:
        return [m for m in self.methods if m.error is not None]

    def as_dict(self) -> dict[str, Any]:
        config = asdict(self.config)
        config["methods"] = list(self.config.methods) if self.config.methods else None
        return {
            "config": config,
            "device": self.device,
            "simulate_time_s": self.simulate_time_s,
            "mean_client_accuracy": self.mean_client_accuracy,
            "clients": [s.as_dict() for s in self.clients],
            "ensemble": self.ensemble.as_dict() if self.ensemble else None,
            "methods": [m.as_dict() for m in self.methods],
            "out_dir": self.out_dir,
        }


# The README's order; methods registered later follow in registration order.
PREFERRED_ORDER = ("avg", "pfnm", "nafi", "ot", "ams")


def registered_methods() -> list[str]:
    """Names of every fusion method registered at run time that fuses plain clients (avg,
    pfnm, nafi, ot, ams first); methods for clients of a special structure (Fed²) are left
    out, since the demo trains plain clients."""
    from fusekit.methods import METHODS

    plain = [m for m, cls in METHODS.items() if cls.client_structure is None]
    known = [m for m in PREFERRED_ORDER if m in plain]
    return known + [m for m in plain if m not in known]


def run_demo(
    config: DemoConfig = DemoConfig(),
    *,
    out_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> DemoReport:
    """Simulate clients, fuse with each method, evaluate every model on the test split.

    Args:
        config: demo settings.
        out_dir: keep client and fused checkpoints here (created if missing); None uses a
            temporary folder removed afterwards.
        force: overwrite existing files in ``out_dir``.

    Returns:
        A :class:`DemoReport`. A method that raises is recorded with its error (the other
        methods still run); check ``report.failed``.

    Raises:
        UnknownMethodError: a requested method is not registered.
        DataError, ParameterError, SpecError, OutputError: bad settings or files.
    """
    methods = list(config.methods) if config.methods else registered_methods()
    unknown = sorted(set(methods) - set(registered_methods()))
    if unknown:
        raise UnknownMethodError(
            f"unknown fusion method(s) {unknown}; choose from {registered_methods()}"
        )
    if out_dir is not None:
        return _run(config, methods, Path(out_dir), force)
    with tempfile.TemporaryDirectory(prefix="fusekit-demo-") as tmp:
        report = _run(config, methods, Path(tmp), force)
        report.out_dir = None
        return report


def _run(
    config: DemoConfig,
    methods: list[str],
    folder: Path,
    force: bool,
) -> DemoReport:
    import fusekit

    dataset = load_dataset(config.data, seed=config.seed)
    evaluator = Evaluator(dataset, config.device)
    sim_config = replace(config, device=str(evaluator.device)).simulation()
    clients_dir = folder / "clients"
    start = time.perf_counter()
    clients = simulate_clients(
        dataset, sim_config, out_dir=clients_dir, device=str(evaluator.device), force=force
    )
    report = DemoReport(
        config=config,
        device=str(evaluator.device),
        simulate_time_s=time.perf_counter() - start,
        out_dir=str(folder),
    )
    paths = [c.path for c in clients]
    client_logits = []
    for path in paths:
        _, logits = evaluator.logits(path)
        client_logits.append(logits)
        report.clients.append(evaluator.score(logits, path.name, "client"))
    report.ensemble = evaluator.ensemble(client_logits)
    for done, method in enumerate(methods, 1):
        run = MethodRun(method)
        try:
            begin = time.perf_counter()
            result = fusekit.fuse(paths, method=method)
            run.fuse_time_s = time.perf_counter() - begin
            run.widths = list(result.widths)
            fused_path = result.save(folder / f"fused-{method}.safetensors", force=force)
            _, logits = evaluator.logits(fused_path)
            run.score = evaluator.score(logits, fused_path.name, "fused", method)
            if config.calibrate and result.assignments is not None:
                run.calibrated = _calibrated_score(fused_path, clients, dataset, evaluator,
                                                   force)
            if config.align and result.assignments is not None:
                run.aligned = _calibrated_score(fused_path, clients, dataset, evaluator,
                                                force, align=True)
        except Exception as exc:  # one failing method must not hide the others
            logger.debug("method %s failed", method, exc_info=True)
            run.error = f"{type(exc).__name__}: {exc}"
            logger.error("method %s failed: %s", method, run.error)
        report.methods.append(run)
        progress.advance("methods fused and scored", done, len(methods))
    return report


def _calibrated_score(fused_path: Path, clients, dataset, evaluator: Evaluator,
                      force: bool, *, align: bool = False) -> Score:
    """Calibrate a fused file with every client's statistics of its own training data
    (and of its own model: REPAIR's targets), layer by layer; with ``align``, then run one
    alignment round and a refit round per layer. Score the result."""
    from fusekit.toolkit.local import align_locally, calibrate_locally

    inputs = [dataset.x_train[c.indices] for c in clients]
    own = [c.checkpoint for c in clients]
    min_samples = min(len(x) for x in inputs)
    if align:
        result = align_locally(fused_path, own, inputs, min_samples=min_samples, device="cpu")
    else:
        result = calibrate_locally(fused_path, inputs, clients=own, min_samples=min_samples,
                                   device="cpu")
    suffix = "-aligned" if align else "-calibrated"
    path = result.save(fused_path.with_name(fused_path.stem + suffix + ".safetensors"),
                       force=force)
    _, logits = evaluator.logits(path)
    return evaluator.score(logits, path.name, "fused", result.method)
