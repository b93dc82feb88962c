"""Data loading, splitting, federated partitioning and storage.

The names below load their module on first use (PEP 562), so importing one light submodule
(``mergeflow.data.check``, ``mergeflow.data.errors``) does not import datasets, flwr-datasets,
scikit-learn and matplotlib: ``mergeflow validate`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "partition": ("PARTITION_METHODS", "partition_dataset", "partition_stats", "plot_partition_stats"),
    "sources": (
        "DataError",
        "load_digits_source",
        "load_source",
        "load_table_source",
        "load_wine_source",
        "make_dataset",
        "make_linreg",
        "make_pinwheel",
    ),
    "split": ("split_dataset", "standardize"),
    "storage": ("load_dataset_file", "save_dataset", "to_arrays"),
}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value
