"""Data loading, splitting, federated partitioning and storage."""

from __future__ import annotations

from mergeflow.data.partition import (
    PARTITION_METHODS,
    partition_dataset,
    partition_stats,
    plot_partition_stats,
)
from mergeflow.data.sources import (
    BUILTIN_SOURCES,
    DataError,
    builtin_size,
    load_digits_source,
    load_hf_source,
    load_source,
    load_wine_source,
    make_dataset,
    make_linreg,
    make_pinwheel,
)
from mergeflow.data.split import split_dataset, standardize
from mergeflow.data.storage import load_dataset_file, save_dataset, to_arrays

__all__ = [
    "BUILTIN_SOURCES",
    "PARTITION_METHODS",
    "DataError",
    "builtin_size",
    "load_dataset_file",
    "load_digits_source",
    "load_hf_source",
    "load_source",
    "load_wine_source",
    "make_dataset",
    "make_linreg",
    "make_pinwheel",
    "partition_dataset",
    "partition_stats",
    "plot_partition_stats",
    "save_dataset",
    "split_dataset",
    "standardize",
    "to_arrays",
]
