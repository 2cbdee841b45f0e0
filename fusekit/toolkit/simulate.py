"""Simulated federated clients: partition a data set, train one model per client, write
one checkpoint per client with fusekit's metadata.

Seeds: the partition uses ``seed``; client i's initial weights use a seed derived from
(``seed``, i) — or ``seed`` alone for every client with ``shared_init`` (FedNLR and the PANs
paper start all clients from one global model) — and its mini-batch order another derived
seed. The same configuration therefore always writes the same checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fusekit.core import metadata as meta
from fusekit.core import progress
from fusekit.core.arch import parse_arch_string, validate_arch, validate_pan
from fusekit.core.checkpoint import Checkpoint, save_checkpoint
from fusekit.core.errors import OutputError, ParameterError
from fusekit.toolkit.data import Dataset, class_counts, partition
from fusekit.toolkit.train import TrainConfig, TrainResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SimulationConfig:
    """How to split the data and train the clients.

    Attributes:
        clients: number of clients S.
        partition: ``iid``, ``dirichlet`` or ``labels`` (ALGORITHMS.md §8).
        alpha: Dirichlet concentration for ``dirichlet``.
        min_classes, max_classes: class-count range for ``labels`` (None: 30%..60% of K).
        min_samples: minimum number of samples per client.
        arch: the CLI short form (``mlp:100``, ``conv:16,32``) or an arch dict, or one of
            either per client (heterogeneous clients).
        batchnorm: BatchNorm after every hidden linear layer of MLPs.
        pan: PAN settings (``{"mode", "amplitude", "period"}``) or None.
        fed2: Fed² structure (``{"groups": G, "depth": d}``, ALGORITHMS.md §9) or None.
        shared_init: every client starts from the same initial weights.
        train: local training settings.
        seed: master seed.
    """

    clients: int = 10
    partition: str = "dirichlet"
    alpha: float = 0.5
    min_classes: int | None = None
    max_classes: int | None = None
    min_samples: int = 10
    arch: str | Mapping[str, Any] | Sequence[str | Mapping[str, Any]] = "mlp:100"
    batchnorm: bool = False
    pan: Mapping[str, Any] | None = None
    fed2: Mapping[str, Any] | None = None
    shared_init: bool = False
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0


@dataclass
class SimulatedClient:
    """One trained client.

    Attributes:
        index: client number i (0-based).
        indices: int64 indices of its training samples in the data set.
        checkpoint: its weights and metadata (in memory).
        path: where the checkpoint was written, or None.
        training: per-epoch losses.
    """

    index: int
    indices: np.ndarray
    checkpoint: Checkpoint
    path: Path | None
    training: TrainResult


def client_archs(config: SimulationConfig, dataset: Dataset) -> list[dict[str, Any]]:
    """The validated architecture of every client.

    Raises:
        SpecError: an architecture string or dict is invalid or does not fit the data.
        ParameterError: a per-client list of the wrong length.
    """
    archs = config.arch
    if isinstance(archs, (str, Mapping)):
        archs = [archs] * config.clients
    archs = list(archs)
    if len(archs) != config.clients:
        raise ParameterError(
            f"arch: expected one architecture or {config.clients} (one per client), "
            f"found {len(archs)}"
        )
    pan = validate_pan(config.pan)
    out = []
    for arch in archs:
        if isinstance(arch, str):
            arch = parse_arch_string(
                arch,
                input_shape=dataset.input_shape,
                num_classes=dataset.num_classes,
                batchnorm=config.batchnorm,
                pan=pan,
            )
        if config.fed2 is not None:
            arch = {**arch, "fed2": config.fed2}
        out.append(validate_arch(arch))
    return out


def derive_seed(seed: int, purpose: str, index: int) -> int:
    """A 31-bit seed for (purpose, client index), independent across purposes."""
    tag = int.from_bytes(purpose.encode()[:8].ljust(8, b"\0"), "little")
    return int(np.random.SeedSequence([seed, tag, index]).generate_state(1)[0] >> 1)


def client_file_name(index: int, n_clients: int) -> str:
    return f"client_{index:0{max(2, len(str(n_clients - 1)))}d}.safetensors"


def simulate_clients(
    dataset: Dataset,
    config: SimulationConfig,
    *,
    out_dir: str | os.PathLike[str] | None = None,
    device: str = "cpu",
    force: bool = False,
) -> list[SimulatedClient]:
    """Partition ``dataset``'s training set, train one model per client, and write
    ``client_XX.safetensors`` files to ``out_dir`` (when given).

    Args:
        dataset: the data set (train split is partitioned; test split is untouched).
        config: partition, architecture and training settings.
        out_dir: output folder (created if missing); None keeps checkpoints in memory.
        device: ``auto``, ``cpu`` or ``cuda``.
        force: overwrite existing client files.

    Returns:
        The clients, in index order.

    Raises:
        ParameterError, SpecError: invalid settings; OutputError: files exist without force.
    """
    from fusekit.toolkit.train import resolve_device, train_model

    torch_device = resolve_device(device)
    archs = client_archs(config, dataset)
    parts = partition(
        dataset.y_train,
        config.clients,
        config.partition,
        alpha=config.alpha,
        min_classes=config.min_classes,
        max_classes=config.max_classes,
        min_samples=config.min_samples,
        seed=config.seed,
    )
    folder = _prepare_out_dir(out_dir, config.clients, force)
    clients = []
    for i, (arch, indices) in enumerate(zip(archs, parts, strict=True)):
        init_seed = config.seed if config.shared_init else derive_seed(config.seed, "init", i)
        model = fresh_model(arch, dataset, seed=init_seed)
        result = train_model(
            model,
            dataset.x_train[indices],
            dataset.y_train[indices],
            config.train,
            seed=derive_seed(config.seed, "order", i),
            device=torch_device,
        )
        checkpoint = client_checkpoint(
            model, dataset, indices, {meta.SIMULATION: json.dumps(_provenance(dataset, config, i))}
        )
        path = None
        if folder is not None:
            path = save_checkpoint(folder / client_file_name(i, config.clients),
                                   checkpoint.state_dict(), checkpoint.metadata, force=force)
        client = SimulatedClient(i, indices, checkpoint, path, result)
        logger.debug(
            "client %d: %d samples, classes %s, final loss %.4f",
            i,
            len(indices),
            [k for k, c in enumerate(checkpoint.class_counts) if c],
            result.epoch_losses[-1],
        )
        clients.append(client)
        progress.advance("clients trained", i + 1, config.clients)
    return clients


def fresh_model(arch: Mapping[str, Any], dataset: Dataset, *, seed: int | None = None) -> Any:
    """A newly initialised model of ``arch`` that normalises its inputs as fusekit's models
    trained on ``dataset`` do (:attr:`Dataset.normalization`; :func:`client_checkpoint`
    records it), so it trains and predicts on the data as stored."""
    from fusekit.toolkit.nn.modules import build_model
    from fusekit.toolkit.nn.preprocess import attach_normalization

    return attach_normalization(build_model(arch, seed=seed), dataset.normalization,
                                dataset.name)


def client_checkpoint(
    model: Any,
    dataset: Dataset,
    indices: np.ndarray | None,
    extra: Mapping[str, str] | None = None,
) -> Checkpoint:
    """A model as an in-memory checkpoint with fusekit's metadata: its architecture, the
    input normalisation of ``dataset``'s models (see :func:`fresh_model`), the sample and
    class counts of its training indices (none when None), and ``extra``."""
    metadata = {meta.ARCH: json.dumps(model.arch), **(extra or {})}
    if dataset.normalization is not None:
        metadata[meta.PREPROCESS] = dataset.normalization.to_json()
    if indices is not None:
        counts = class_counts(dataset.y_train, indices, dataset.num_classes)
        metadata[meta.NUM_SAMPLES] = str(len(indices))
        metadata[meta.CLASS_COUNTS] = json.dumps(counts)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return Checkpoint.from_state_dict(state, metadata)


def _prepare_out_dir(
    out_dir: str | os.PathLike[str] | None, n_clients: int, force: bool
) -> Path | None:
    if out_dir is None:
        return None
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{folder}: --out must be a directory, found a file")
    folder.mkdir(parents=True, exist_ok=True)
    existing = [
        folder / client_file_name(i, n_clients)
        for i in range(n_clients)
        if (folder / client_file_name(i, n_clients)).exists()
    ]
    if existing and not force:
        raise OutputError(
            f"{existing[0]}: output file exists ({len(existing)} client file(s) in {folder}); "
            "pass --force to replace them"
        )
    return folder


def _provenance(dataset: Dataset, config: SimulationConfig, index: int) -> dict[str, Any]:
    train = asdict(config.train)
    return {
        "data": dataset.name,
        "client": index,
        "clients": config.clients,
        "partition": config.partition,
        "alpha": config.alpha if config.partition == "dirichlet" else None,
        "seed": config.seed,
        "shared_init": config.shared_init,
        "train": train,
    }
