"""The in-memory layout every source loads into, and the facts (``info``) that go with it.

A loaded source is ``(dataset, info)``: a ``datasets.Dataset`` with a float32 list column ``"x"``
(features flattened to 1-D) or string columns ``"text"`` (and ``"text_pair"``), a target column ``"y"``
(int64 class id or float32 regression target), optionally a string column ``"group"``, plus a
JSON-serialisable ``info`` dict describing the task.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:  # datasets loads where it is used: `mergeflow validate` does not need it
    import datasets


def list_array(x: np.ndarray) -> pa.ListArray:
    """Arrow ``list<float32>`` column from an ``(N, ...)`` array, rows flattened."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    x = x.reshape(x.shape[0], int(np.prod(x.shape[1:])))
    offsets = np.arange(len(x) + 1, dtype=np.int32) * x.shape[1]
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(x.ravel()))


def wrap_table(table: pa.Table) -> datasets.Dataset:
    """In-memory dataset over ``table``, fingerprinted by a content hash.

    ``datasets`` would otherwise fingerprint it by pickling the whole table, which is slow.
    """
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    import datasets

    return datasets.Dataset(table, fingerprint=hashlib.sha256(sink.getvalue()).hexdigest()[:32])


def make_dataset(
    x: np.ndarray, y: np.ndarray, group: np.ndarray | list[str] | None = None, row: np.ndarray | None = None
) -> datasets.Dataset:
    """Build an in-memory dataset in the ``x`` / ``y`` / ``group`` / ``row`` layout.

    ``y`` keeps its dtype (int64 for classes, float32 for regression targets); ``row`` is each
    row's number in the source table, to trace a prediction back to it.
    """
    columns: dict[str, pa.Array] = {"x": list_array(x), "y": pa.array(np.asarray(y))}
    if group is not None:
        columns["group"] = pa.array([str(g) for g in group], type=pa.string())
    if row is not None:
        columns["row"] = pa.array(np.asarray(row, dtype=np.int64))
    return wrap_table(pa.table(columns))


def make_text_dataset(
    texts: list[str] | pa.Array,
    labels: np.ndarray,
    *,
    pairs: list[str] | pa.Array | None = None,
    groups: list[str] | None = None,
) -> datasets.Dataset:
    """An in-memory dataset in the text layout: ``text`` (``text_pair``), ``y`` and ``group``."""
    columns: dict[str, pa.Array] = {"text": pa.array(texts, type=pa.string())}
    if pairs is not None:
        columns["text_pair"] = pa.array(pairs, type=pa.string())
    columns["y"] = pa.array(np.asarray(labels, dtype=np.int64))
    if groups is not None:
        columns["group"] = pa.array([str(g) for g in groups], type=pa.string())
    return wrap_table(pa.table(columns))


def classification_info(
    source: str, num_classes: int, input_shape: list[int], class_names: list[str] | None
) -> dict[str, Any]:
    """The ``info`` of a classification source of numeric features."""
    return {
        "source": source,
        "task": "classification",
        "num_classes": num_classes,
        "input_shape": input_shape,
        "class_names": class_names,
    }


def text_info(source: str, num_classes: int, class_names: list[str] | None, *, pair: bool) -> dict[str, Any]:
    """The ``info`` of a text classification source; the tokenize step sets its ``input_shape``."""
    return {
        "source": source,
        "modality": "text",
        "task": "classification",
        "num_classes": int(num_classes),
        "class_names": class_names,
        "pair": pair,
        "input_shape": None,  # set by the tokenize step: [max_length]
    }


class RawData(NamedTuple):
    """A source before feature encoding: its raw feature columns, targets, groups, task facts and
    each row's number in the source table (rows with missing values may have been dropped)."""

    features: pa.Table
    y: np.ndarray
    group: np.ndarray | None
    info: dict[str, Any]
    source_rows: np.ndarray


def raw_from_dataset(ds: datasets.Dataset, info: dict[str, Any]) -> RawData:
    """A loaded source's rows before feature encoding: its one list column ``"x"`` is the raw feature."""
    table = ds.with_format("arrow")[:]
    group = np.asarray(table.column("group").to_pylist(), dtype=str) if "group" in table.column_names else None
    return RawData(table.select(["x"]), table.column("y").to_numpy(), group, info, np.arange(table.num_rows))
