"""A task's own label set out of a source's labels (params ``tasks.<name>.labels``).

A mapping from the source's class ids to the task's: rows whose label is not a key are dropped, and the task's
classes are the mapping's values, renumbered 0..C-1 in sorted order. Digits' classes 0–4, or their parity, are
tasks of their own this way, each with its own head.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from mergeflow.data.errors import DataError
from mergeflow.data.rows import RawData

if TYPE_CHECKING:
    import datasets


def _mapping(labels: Mapping[int, int], info: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
    """A lookup table from source class id to task class id (-1: dropped), and the task's ``info``."""
    classes = int(info["num_classes"])
    unknown = sorted(int(k) for k in labels if not 0 <= int(k) < classes)
    if unknown:
        raise DataError(f"labels: the source has no class {unknown[0]} (its classes are 0..{classes - 1})")
    values = sorted(set(labels.values()))
    lookup = np.full(classes, -1, dtype=np.int64)
    for source, task in labels.items():
        lookup[int(source)] = values.index(task)
    names = info.get("class_names") or [str(c) for c in range(classes)]
    task_names = ["+".join(names[s] for s in sorted(labels) if lookup[s] == t) for t in range(len(values))]
    return lookup, info | {"num_classes": len(values), "class_names": task_names, "relabelled": True}


def relabel_raw(raw: RawData, labels: Mapping[int, int]) -> RawData:
    """``raw`` with the task's labels: rows of other labels dropped, the kept ones mapped."""
    lookup, info = _mapping(labels, raw.info)
    y = lookup[raw.y]
    keep = np.flatnonzero(y >= 0)
    group = raw.group[keep] if raw.group is not None else None
    return RawData(raw.features.take(keep), y[keep], group, info, raw.source_rows[keep])


def relabel_dataset(dataset: datasets.Dataset, info: dict[str, Any], labels: Mapping[int, int]):
    """A loaded (text) dataset with the task's labels: rows of other labels dropped; and the task's ``info``."""
    import pyarrow as pa

    from mergeflow.data.rows import wrap_table

    lookup, task_info = _mapping(labels, info)
    table = dataset.with_format("arrow")[:]
    y = lookup[table.column("y").to_numpy()]
    keep = np.flatnonzero(y >= 0)
    table = table.take(keep).set_column(table.column_names.index("y"), "y", pa.array(y[keep]))
    return wrap_table(table), task_info
