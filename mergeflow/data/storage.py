"""Parquet storage of datasets and conversion to numpy arrays."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mergeflow.data.errors import DataError
from mergeflow.data.rows import wrap_table

if TYPE_CHECKING:  # datasets loads where it is used: planning a run does not need it
    import datasets


def arrow_table(ds: datasets.Dataset) -> pa.Table:
    """The rows of ``ds`` as a pyarrow table, with any ``select``/``shuffle`` applied."""
    return ds.with_format("arrow")[:]


def feature_matrix(ds: datasets.Dataset | pa.Table) -> np.ndarray:
    """The ``"x"`` column as an ``(N, D)`` array read from arrow without Python lists: float32, or
    int64 for integer columns (token ids)."""
    table = ds if isinstance(ds, pa.Table) else arrow_table(ds)
    column = table.column("x").combine_chunks()
    values = column.flatten().to_numpy(zero_copy_only=False)
    values = values.astype(np.int64 if np.issubdtype(values.dtype, np.integer) else np.float32, copy=False)
    width = values.size // len(column) if len(column) else 0
    return values.reshape(len(column), width)


def _canonical(table: pa.Table) -> pa.Table:
    """Name list items ``item`` whatever the table was read from (parquet says ``element``)."""
    fields = [
        pa.field(f.name, pa.list_(f.type.value_type), f.nullable) if pa.types.is_list(f.type) else f
        for f in table.schema
    ]
    return table.cast(pa.schema(fields, metadata=table.schema.metadata))


def save_dataset(ds: datasets.Dataset, path: str | Path) -> None:
    """Write ``ds`` to a parquet file atomically; identical data gives identical bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(_canonical(arrow_table(ds)), tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_dataset_file(path: str | Path) -> datasets.Dataset:
    """Read a parquet file written by ``save_dataset`` into an in-memory dataset."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset file {str(path)!r} does not exist")
    return wrap_table(pq.read_table(path))


def to_arrays(ds: datasets.Dataset, info: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Features as float32 ``(N, *input_shape)`` (int64 token ids for text) and targets as int64
    (classes) or float32."""
    table = arrow_table(ds)
    x = feature_matrix(table).reshape(table.num_rows, *info["input_shape"])
    y_dtype = np.float32 if info["task"] == "regression" else np.int64
    y = table.column("y").to_numpy().astype(y_dtype, copy=False)
    return x, y
