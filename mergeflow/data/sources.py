"""Data sources: built-in toy sets and any table that ``datasets.load_dataset`` reads.

Every loader returns ``(dataset, info)``: a ``datasets.Dataset`` with a float32 list
column ``"x"`` (features flattened to 1-D), a target column ``"y"`` (int64 class id or
float32 regression target) and optionally a string column ``"group"``, plus a
JSON-serialisable ``info`` dict describing the task.
"""

from __future__ import annotations

import glob
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow as pa

from mergeflow.data.errors import DataError
from mergeflow.errors import did_you_mean
from mergeflow.schema.sources import SOURCES, canonical_name

if TYPE_CHECKING:  # datasets and scikit-learn load where they are used: `mergeflow validate` needs neither
    import datasets
from mergeflow.data.features import (
    Categorical,
    Missing,
    fit_encoder,
    is_categorical,
    missing_error,
    missing_rows,
    text_column_error,
)

LABEL_TASKS = ("classification", "regression")  # what a table's label column is; the objectives are training.OBJECTIVES

_FILE_SUFFIXES = (".csv", ".tsv", ".parquet", ".json", ".jsonl", ".txt", ".arrow")


# Numeric labels with more distinct values than this may be a regression target (see _looks_like_regression).
_REGRESSION_HINT_VALUES = 20

__all__ = ["DataError"]


def _list_array(x: np.ndarray) -> pa.ListArray:
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
    columns: dict[str, pa.Array] = {"x": _list_array(x), "y": pa.array(np.asarray(y))}
    if group is not None:
        columns["group"] = pa.array([str(g) for g in group], type=pa.string())
    if row is not None:
        columns["row"] = pa.array(np.asarray(row, dtype=np.int64))
    return wrap_table(pa.table(columns))


def _classification_info(
    source: str, num_classes: int, input_shape: list[int], class_names: list[str] | None
) -> dict[str, Any]:
    return {
        "source": source,
        "task": "classification",
        "num_classes": num_classes,
        "input_shape": input_shape,
        "class_names": class_names,
    }


def load_digits_source() -> tuple[datasets.Dataset, dict[str, Any]]:
    """The sklearn 8x8 digits (1797 images, 10 classes), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    ds = make_dataset(bunch.data / 16.0, bunch.target.astype(np.int64))
    names = [str(c) for c in range(10)]
    return ds, _classification_info("digits", 10, [1, 8, 8], names) | {"class_values": list(range(10))}


def load_wine_source() -> tuple[datasets.Dataset, dict[str, Any]]:
    """The sklearn wine set (178 rows, 13 raw features, 3 classes)."""
    from sklearn.datasets import load_wine

    bunch = load_wine()
    ds = make_dataset(bunch.data, bunch.target.astype(np.int64))
    names = [str(n) for n in bunch.target_names]
    return ds, _classification_info("wine", 3, [13], names)


def make_pinwheel(
    clusters: int = 5,
    per_cluster: int = 1000,
    radial_std: float = 0.3,
    tangential_std: float = 0.05,
    rate: float = 0.25,
    seed: int = 0,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """The 2-D pinwheel of Johnson et al. (2016); the class id is the cluster (arm)."""
    rng = np.random.default_rng(seed)
    rads = np.linspace(0, 2 * np.pi, clusters, endpoint=False)
    features = rng.standard_normal((clusters * per_cluster, 2)) * np.array([radial_std, tangential_std])
    features[:, 0] += 1.0
    labels = np.repeat(np.arange(clusters, dtype=np.int64), per_cluster)
    angles = rads[labels] + rate * np.exp(features[:, 0])
    cos, sin = np.cos(angles), np.sin(angles)
    rotations = np.stack([cos, -sin, sin, cos], axis=1).reshape(-1, 2, 2)
    points = np.einsum("ti,tij->tj", features, rotations)
    return make_dataset(points, labels), _classification_info("pinwheel", clusters, [2], None)


def make_linreg(
    n: int = 1000,
    dim: int = 10,
    noise_std: float = 0.5,
    prior_std: float = 1.0,
    seed: int = 0,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """Bayesian linear regression with known truth: ``y = X w + noise_std * eps``.

    ``w ~ N(0, prior_std^2 I)``, ``X ~ N(0, I)``, no bias term.
    """
    rng = np.random.default_rng(seed)
    weights = rng.normal(0.0, prior_std, size=dim)
    x = rng.standard_normal((n, dim))
    y = x @ weights + noise_std * rng.standard_normal(n)
    info = {
        "source": "linreg",
        "task": "regression",
        "num_classes": None,
        "input_shape": [dim],
        "class_names": None,
        "noise_std": float(noise_std),
        "prior_std": float(prior_std),
        "true_weights": [float(w) for w in weights],
    }
    return make_dataset(x, y.astype(np.float32)), info


def _check_local_files(data_files: str | list[str] | dict | None) -> None:
    """Raise ``DataError`` naming the first local data file that does not exist."""
    if data_files is None:
        return
    if isinstance(data_files, str):
        files: list[str] = [data_files]
    elif isinstance(data_files, dict):
        files = [f for v in data_files.values() for f in ([v] if isinstance(v, str) else v)]
    else:
        files = list(data_files)
    for name in files:
        if "://" in name:
            continue
        if any(ch in name for ch in "*?["):
            if not glob.glob(name, recursive=True):
                raise DataError(f"data file pattern {name!r} matches no file")
        elif not Path(name).expanduser().exists():
            raise DataError(f"data file {name!r} does not exist")


def _missing_column(key: str, column: str, present: list[str]) -> DataError:
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


def _labels(
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


class RawData(NamedTuple):
    """A source before feature encoding: its raw feature columns, targets, groups, task facts and
    each row's number in the source table (rows with missing values may have been dropped)."""

    features: pa.Table
    y: np.ndarray
    group: np.ndarray | None
    info: dict[str, Any]
    source_rows: np.ndarray


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
        raise _missing_column("data.table.label_column", label_column, present)
    if group_column is not None and group_column not in present:
        raise _missing_column("data.table.group_column", group_column, present)
    if feature_columns is None:
        feature_columns = [c for c in present if c not in (label_column, group_column)]
    if not feature_columns:
        raise DataError(f"dataset {path!r} has no feature columns besides the label")
    for column in feature_columns:
        if column not in present:
            raise _missing_column("data.table.feature_columns", column, present)
    loaded = raw.num_rows
    source_rows = np.arange(loaded)
    if missing == "drop_rows":
        keep = ~missing_rows(raw.with_format("arrow")[:], [*feature_columns, label_column])
        if not keep.any():
            raise DataError(f"every row of {path!r} has a missing value; data.missing: drop_rows leaves none")
        source_rows = np.flatnonzero(keep)
        raw = raw.select(source_rows)
    table = raw.with_format("arrow")[:]
    y, class_names = _labels(table, label_column, task, raw.features[label_column])
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


def load_table_source(path: str, **options: Any) -> tuple[datasets.Dataset, dict[str, Any]]:
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


def load_source(
    source: str, *, seed: int = 0, options: dict[str, Any] | None = None
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """Load a registered source by name (:mod:`mergeflow.schema.sources`) with ``options``, its
    ``data.<name>`` section (defaults for the keys left out); ``seed`` drives the synthetic sources.

    Raises:
        DataError: for an unknown source or options it does not take.
    """
    try:
        spec = SOURCES[canonical_name(source)]
        chosen = spec.parse(options).model_dump()
    except ValueError as error:
        raise DataError(str(error)) from None
    return spec.load(chosen, seed=seed)


def raw_from_dataset(ds: datasets.Dataset, info: dict[str, Any]) -> RawData:
    """A loaded source's rows before feature encoding: its one list column ``"x"`` is the raw feature."""
    table = ds.with_format("arrow")[:]
    group = np.asarray(table.column("group").to_pylist(), dtype=str) if "group" in table.column_names else None
    return RawData(table.select(["x"]), table.column("y").to_numpy(), group, info, np.arange(table.num_rows))
