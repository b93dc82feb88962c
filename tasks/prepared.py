"""Reading the prepared data: a split's arrays, its groups and the dataset's facts, as every step reads them.

Apart from the steps that write the data (:mod:`tasks.data`), so that a step reading it imports no
other step's code (nor its cache key: :attr:`tasks.steps.Step.code`).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from mergeflow.data.storage import load_dataset_file, to_arrays
from tasks.layout import PREPARED
from tasks.store import file_signature


class _Parsed(NamedTuple):
    signature: tuple
    info: str
    X: np.ndarray
    y: np.ndarray


# Parsed arrays by absolute path: federated rounds read every client's partition once a round.
_ARRAYS: dict[str, _Parsed] = {}
_ARRAYS_LOCK = threading.Lock()
_ARRAYS_MAX_BYTES = 512 << 20


def read_arrays(path: Path, info: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """A parquet split as (X, y) arrays, parsed once per process while the file is unchanged.

    Callers get their own copies, so they may modify them.
    """
    signature, info_key = file_signature(path), json.dumps(info, sort_keys=True)
    with _ARRAYS_LOCK:
        entry = _ARRAYS.get(signature[0])
    if entry is None or (entry.signature, entry.info) != (signature, info_key):
        entry = _Parsed(signature, info_key, *to_arrays(load_dataset_file(path), info))
        with _ARRAYS_LOCK:
            if sum(e.X.nbytes + e.y.nbytes for e in _ARRAYS.values()) > _ARRAYS_MAX_BYTES:
                _ARRAYS.clear()
            _ARRAYS[signature[0]] = entry
    return entry.X.copy(), entry.y.copy()


def read_groups(path: Path) -> np.ndarray | None:
    """The ``group`` column of a parquet split as strings, or None when the data has no groups."""
    import pyarrow.parquet as pq

    if "group" not in pq.read_schema(path).names:
        return None
    return np.asarray(pq.read_table(path, columns=["group"]).column("group").to_pylist(), dtype=str)


def read_info(root: Path, directory: str = PREPARED) -> dict[str, Any]:
    """The dataset facts (task, classes, input shape) saved beside the data."""
    return json.loads((root / directory / "info.json").read_text())
