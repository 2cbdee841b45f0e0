"""Data sets and client partitions for simulation and evaluation (numpy only, no torch)."""

from fusekit.toolkit.data.datasets import (
    DATASETS,
    Dataset,
    cifar10,
    dataset_name,
    digits,
    idx_dataset,
    load_dataset,
    npz_dataset,
    synthetic,
    token_ids,
)
from fusekit.toolkit.data.partitions import (
    PARTITIONS,
    class_counts,
    dirichlet_partition,
    iid_partition,
    label_partition,
    partition,
)

__all__ = [
    "DATASETS",
    "PARTITIONS",
    "Dataset",
    "cifar10",
    "class_counts",
    "dataset_name",
    "digits",
    "dirichlet_partition",
    "idx_dataset",
    "iid_partition",
    "label_partition",
    "load_dataset",
    "npz_dataset",
    "partition",
    "synthetic",
    "token_ids",
]
