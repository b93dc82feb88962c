"""The loader of the ``table`` source: the user's own table, read with ``datasets.load_dataset``; and the
reading of a table that the text source shares (:func:`load_table`, :func:`labels`, :func:`missing_column`)."""

from __future__ import annotations

import glob
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import numpy as np
import pyarrow as pa

from mergeflow.data.errors import DataError
from mergeflow.data.features import (
    Categorical,
    Missing,
    fit_encoder,
    is_categorical,
    missing_error,
    missing_rows,
    text_column_error,
)
from mergeflow.data.loader import Loaded, SourceLoader
from mergeflow.data.rows import RawData, make_dataset
from mergeflow.errors import did_you_mean
from mergeflow.schema.data_source import DataFiles, LabelTask, files_listed
from mergeflow.schema.sources.table import TableOptions

if TYPE_CHECKING:  # datasets loads where it is used: `mergeflow validate` does not need it
    import datasets

LABEL_TASKS = get_args(LabelTask)  # what a table's label column is (the objectives are mergeflow.objectives')

_FILE_SUFFIXES = (".csv", ".tsv", ".parquet", ".json", ".jsonl", ".txt", ".arrow")

# Numeric labels with more distinct values than this may be a regression target (see _looks_like_regression).
_REGRESSION_HINT_VALUES = 20


def _check_local_files(data_files: DataFiles) -> None:
    """Raise ``DataError`` naming the first local data file that does not exist."""
    for name in files_listed(data_files):
        if "://" in name:
            continue
        if any(ch in name for ch in "*?["):
            if not glob.glob(name, recursive=True):
                raise DataError(f"data file pattern {name!r} matches no file")
        elif not Path(name).expanduser().exists():
            raise DataError(f"data file {name!r} does not exist")


def missing_column(key: str, column: str, present: list[str]) -> DataError:
    """The one line for a column the table lacks, naming the option that asks for it (``data.table.label_column``)."""
    hint = did_you_mean(column, present)
    return DataError(f"{key}: no column {column!r} in the table{hint}; columns: {', '.join(present)}")


def _looks_like_regression(uniques: np.ndarray, rows: int) -> bool:
    """Numeric class labels that are more likely a regression target: many distinct floats, or so many
    distinct integers that a class averages fewer than five rows."""
    if len(uniques) <= _REGRESSION_HINT_VALUES:
        return False
    if np.issubdtype(uniques.dtype, np.floating):
        return True
    return np.issubdtype(uniques.dtype, np.integer) and rows < 5 * len(uniques)


def labels(
    table: pa.Table, column: str, task: str, feature: datasets.features.FeatureType | None = None
) -> tuple[np.ndarray, list[str] | None]:
    """Targets as int64 class ids (plus class names when remapped, or the names of a ``ClassLabel``
    ``feature``) or float32 values."""
    arr = table.column(column).combine_chunks()
    if arr.null_count:
        raise missing_error(column, arr.null_count, len(arr), label=True)
    values = arr.to_numpy(zero_copy_only=False)
    if task == "regression":
        try:
            return values.astype(np.float32), None
        except (TypeError, ValueError) as exc:
            raise DataError(f"regression label column {column!r} is not numeric") from exc
    import datasets

    if isinstance(feature, datasets.ClassLabel):
        return values.astype(np.int64), list(feature.names)
    uniques, codes = np.unique(values, return_inverse=True)
    if _looks_like_regression(uniques, len(values)):
        raise DataError(
            f"label column {column!r} holds {len(uniques)} distinct numbers in {len(values)} rows: it looks like "
            "a regression target; set data.table.task: regression (or make the labels strings to keep them as classes)"
        )
    contiguous = np.issubdtype(uniques.dtype, np.integer) and np.array_equal(uniques, np.arange(len(uniques)))
    if contiguous:
        return values.astype(np.int64), None
    return codes.astype(np.int64), [str(u) for u in uniques]


def load_table(
    path: str, *, name: str | None = None, data_files: str | list[str] | dict | None = None, split: str = "train"
) -> datasets.Dataset:
    """One split read with ``datasets.load_dataset``: a builder (``csv``, ``json``, ``parquet``) with
    local ``data_files``, or a hub name (needs network); ``DataError`` for missing files or no rows."""
    import datasets

    local = path.startswith((".", "/", "~")) or Path(path).suffix in _FILE_SUFFIXES
    if local and not Path(path).expanduser().exists():
        raise DataError(f"data path {path!r} does not exist")
    _check_local_files(data_files)
    try:
        raw = datasets.load_dataset(path, name=name, data_files=data_files, split=split)
    except (OSError, ValueError) as exc:
        raise DataError(f"could not load dataset {path!r}: {exc}") from exc
    if raw.num_rows == 0:
        raise DataError(f"dataset {path!r} split {split!r} has no rows")
    return raw


def load_table_raw(
    path: str,
    *,
    name: str | None = None,
    data_files: str | list[str] | dict | None = None,
    split: str = "train",
    feature_columns: list[str] | None = None,
    label_column: str = "label",
    task: str = "classification",
    group_column: str | None = None,
    input_shape: list[int] | None = None,
    missing: Missing = "error",
    categorical: Categorical = "error",
) -> RawData:
    """Load a table with ``datasets.load_dataset`` and check it, keeping the feature columns raw.

    ``path`` is a builder ("csv", "parquet", "json") used with local ``data_files``, or a Hub
    dataset name (needs network). ``feature_columns=None`` takes every column but the label and
    group columns. String or non-contiguous class labels are mapped to ``0..C-1`` in sorted order.
    ``missing="drop_rows"`` drops the rows with a missing feature or label; otherwise a missing
    label, and under ``"error"`` a missing feature, is a ``DataError`` naming the column. Text
    feature columns are a ``DataError`` unless ``categorical="onehot"``. ``info["input_shape"]``
    is the shape given, or None until the features are encoded.
    """
    if task not in LABEL_TASKS:
        raise DataError(f"task must be one of {', '.join(LABEL_TASKS)}, got {task!r}")
    raw = load_table(path, name=name, data_files=data_files, split=split)
    present = list(raw.column_names)
    if label_column not in present:
        raise missing_column("data.table.label_column", label_column, present)
    if group_column is not None and group_column not in present:
        raise missing_column("data.table.group_column", group_column, present)
    if feature_columns is None:
        feature_columns = [c for c in present if c not in (label_column, group_column)]
    if not feature_columns:
        raise DataError(f"dataset {path!r} has no feature columns besides the label")
    for column in feature_columns:
        if column not in present:
            raise missing_column("data.table.feature_columns", column, present)
    loaded = raw.num_rows
    source_rows = np.arange(loaded)
    if missing == "drop_rows":
        keep = ~missing_rows(raw.with_format("arrow")[:], [*feature_columns, label_column])
        if not keep.any():
            raise DataError(f"every row of {path!r} has a missing value; data.missing: drop_rows leaves none")
        source_rows = np.flatnonzero(keep)
        raw = raw.select(source_rows)
    table = raw.with_format("arrow")[:]
    y, class_names = labels(table, label_column, task, raw.features[label_column])
    features = table.select(feature_columns)
    text = [c for c in feature_columns if is_categorical(features.schema.field(c).type, "error")]
    if text and categorical == "error":
        raise text_column_error(text[0], features.schema.field(text[0]).type)
    if missing == "error":
        for column in feature_columns:
            gaps = int(missing_rows(features, [column]).sum())
            if gaps:
                raise missing_error(column, gaps, features.num_rows)
    group = np.asarray(table.column(group_column).to_pylist(), dtype=str) if group_column is not None else None
    info = {
        "source": f"table:{path}",
        "task": task,
        "num_classes": None,
        "input_shape": list(input_shape) if input_shape is not None else None,
        "class_names": None,
        "dropped_rows": loaded - raw.num_rows,
    }
    if task == "classification":
        info["num_classes"] = len(class_names) if class_names else int(y.max()) + 1
        info["class_names"] = class_names
        column = table.column(label_column)
        if class_names and (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
            info["class_values"] = np.unique(column.to_numpy()).tolist()  # numbers, as the labels were
    return RawData(features, y, group, info, source_rows)


def load_table_source(path: str, **options: Any) -> Loaded:
    """Load a table (options as :func:`load_table_raw`) in the x/y/group layout, features encoded over all
    rows without standardisation; the pipeline's prepare step fits the encoding on the training split."""
    raw = load_table_raw(path, **options)
    encoder = fit_encoder(
        raw.features,
        raw.features.column_names,
        standardize=False,
        categorical=options.get("categorical", "error"),
        missing=options.get("missing", "error"),
    )
    x = encoder.transform(raw.features)
    info = dict(raw.info)
    shape = info["input_shape"] or [x.shape[1]]
    if int(np.prod(shape)) != x.shape[1]:
        raise DataError(f"input_shape {shape} does not match the {x.shape[1]} feature values per row")
    info["input_shape"] = shape
    return make_dataset(x, raw.y, raw.group), info


class TableLoader(SourceLoader):
    """Reads the user's table with the data section's policies for gaps and text columns."""

    def load(self, options: TableOptions, *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        return load_table_source(**_with_policies(options, data))

    def load_raw(self, options: TableOptions, *, seed: int = 0, data: Mapping[str, Any] | None = None) -> RawData:
        return load_table_raw(**_with_policies(options, data))

    def check(self, options: TableOptions, *, seed: int = 0, data: Mapping[str, Any] | None = None) -> None:
        self.load_raw(options, seed=seed, data=data)


def _with_policies(options: TableOptions, data: Mapping[str, Any] | None) -> dict[str, Any]:
    """A table's options with the data section's policies for missing values and text columns."""
    policies = {key: (data or {}).get(key, "error") for key in ("missing", "categorical")}
    return options.model_dump() | policies
