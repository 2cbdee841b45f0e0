"""What the ServerApp and the ClientApp share: the data, each node's part of it, the model."""

from __future__ import annotations

from typing import Any

import numpy as np

from fusekit.core.arch import parse_arch_string
from fusekit.toolkit.data import Dataset, load_dataset, partition

DATA = "digits"  # scikit-learn's bundled digits: nothing to download


def dataset() -> Dataset:
    return load_dataset(DATA)


def architecture(run_config: dict[str, Any], data: Dataset) -> dict[str, Any]:
    """The clients' model, from the run config's short form (``mlp:100``), with BatchNorm
    after every hidden layer when ``batchnorm`` is set."""
    return parse_arch_string(str(run_config["arch"]), input_shape=data.input_shape,
                             num_classes=data.num_classes,
                             batchnorm=bool(run_config["batchnorm"]))


def node_indices(run_config: dict[str, Any], node_config: dict[str, Any],
                 data: Dataset) -> np.ndarray:
    """This node's training examples. Every node computes the same seeded split of the
    training set and keeps part ``partition-id`` of ``num-partitions``."""
    parts = partition(data.y_train, int(node_config["num-partitions"]),
                      str(run_config["partition"]), alpha=float(run_config["alpha"]),
                      seed=int(run_config["seed"]))
    return parts[int(node_config["partition-id"])]


def method_params(run_config: dict[str, Any], method: str) -> dict[str, Any]:
    """The method's parameters: the run config's ``[<method>]`` table (``pfnm.width_ratio`` ...)."""
    prefix = f"{method}."
    return {key[len(prefix):]: value for key, value in run_config.items()
            if key.startswith(prefix)}
