"""Raw table columns to the model's feature vector: numbers, one-hot categories, filled gaps, standardisation.

A :class:`FeatureEncoder` is fitted on the training split only and is a plain JSON-able dict
underneath, so the same transform is applied to every split and, stored with a logged model,
to raw inputs at prediction time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mergeflow.data.errors import DataError

Standardize = Literal["auto"] | bool
Categorical = Literal["error", "onehot"]
Missing = Literal["error", "drop_rows", "mean"]

# auto standardises unless every numeric value is already near unit scale: root-mean-square in
# [1/_UNIT_SCALE, _UNIT_SCALE] and standard deviations within a factor _UNIT_SCALE of each other.
_UNIT_SCALE = 10.0


def _is_list(arrow_type: pa.DataType) -> bool:
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type)


def _is_text(arrow_type: pa.DataType) -> bool:
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_dictionary(arrow_type)


def is_categorical(arrow_type: pa.DataType, categorical: Categorical) -> bool:
    """Whether a column of this type is one-hot encoded: text always is, booleans with ``onehot``."""
    return _is_text(arrow_type) or (categorical == "onehot" and pa.types.is_boolean(arrow_type))


def numeric_block(table: pa.Table, column: str) -> np.ndarray:
    """A column of numbers or fixed-length lists of numbers as ``(N, k)`` float64, missing values as NaN."""
    arr = table.column(column).combine_chunks()
    while _is_list(arr.type):
        lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
        if arr.null_count or (len(lengths) and (lengths != lengths[0]).any()):
            raise DataError(f"feature column {column!r} holds missing lists or lists of different lengths")
        arr = arr.flatten()
    if not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type)):
        raise DataError(f"feature column {column!r} has type {arr.type}; features must be numbers or lists of numbers")
    values = arr.cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False)
    return values.reshape(table.num_rows, -1)


def category_values(table: pa.Table, column: str) -> list[str | None]:
    """A categorical column as strings (booleans as ``"True"``/``"False"``), None where missing."""
    return [None if v is None else str(v) for v in table.column(column).to_pylist()]


def one_hot(values: list[str | None], categories: list[str]) -> np.ndarray:
    """``(N, len(categories))`` indicators; a value outside ``categories`` (sorted), or None, is all zeros."""
    block = np.zeros((len(values), len(categories)))
    if not categories or not values:
        return block
    known = np.asarray(categories)
    strings = np.asarray(["" if v is None else v for v in values])
    position = np.minimum(np.searchsorted(known, strings), len(known) - 1)
    hit = (known[position] == strings) & np.asarray([v is not None for v in values])
    block[np.flatnonzero(hit), position[hit]] = 1.0
    return block


def missing_rows(table: pa.Table, columns: list[str]) -> np.ndarray:
    """Boolean mask of the rows with a missing value (null or NaN) in any of ``columns``."""
    mask = np.zeros(table.num_rows, dtype=bool)
    for column in columns:
        arr = table.column(column).combine_chunks()
        if _is_text(arr.type) or pa.types.is_boolean(arr.type):
            mask |= arr.is_null().to_numpy(zero_copy_only=False)
        else:
            mask |= np.isnan(numeric_block(table, column)).any(axis=1)
    return mask


def text_column_error(column: str, arrow_type: pa.DataType) -> DataError:
    """The one line for a text feature column under ``data.categorical: error``."""
    return DataError(
        f"feature column {column!r} holds text ({arrow_type}); set data.categorical: onehot to one-hot "
        "encode it, or leave it out of data.table.feature_columns"
    )


def missing_error(column: str, count: int, rows: int, *, label: bool = False) -> DataError:
    """The one line for missing values in a feature (or ``label``) column, with the settings that handle them."""
    hint = "set data.missing: drop_rows (drop those rows) or mean (fill with the training mean)"
    if label:
        hint = "set data.missing: drop_rows; a missing label cannot be filled"
    return DataError(f"column {column!r} has {count} missing value(s) in {rows} rows; {hint}")


@dataclass
class EncodedColumn:
    """How one raw column becomes part of the feature vector."""

    name: str
    kind: Literal["numeric", "onehot"]
    width: int
    categories: list[str] | None = None  # onehot: the training split's categories, sorted
    fill: list[float] | None = None  # numeric with data.missing: mean: the training means


@dataclass
class FeatureEncoder:
    """A fitted transform from raw columns to float32 features (see :func:`fit_encoder`)."""

    columns: list[EncodedColumn]
    mean: list[float] | None = None  # standardisation per output value; None = not standardised
    std: list[float] | None = None
    standardize: Standardize = "auto"
    reason: str = ""

    @property
    def width(self) -> int:
        """Feature values per row."""
        return sum(c.width for c in self.columns)

    @property
    def standardized(self) -> bool:
        """Whether the features are z-scored."""
        return self.mean is not None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description (what ``info.json`` and a logged model store)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FeatureEncoder:
        """The encoder :meth:`to_dict` described."""
        columns = [EncodedColumn(**c) for c in data["columns"]]
        return cls(**{**data, "columns": columns})

    def transform(self, table: pa.Table) -> np.ndarray:
        """``(N, width)`` float32 features of a table holding the raw columns (extra columns are ignored).

        Unseen categories and, under ``mean``, missing categories give all-zero one-hot values;
        missing numbers are filled with the training mean, or are a ``DataError`` otherwise.
        """
        present = set(table.column_names)
        absent = [c.name for c in self.columns if c.name not in present]
        if absent:
            raise DataError(f"input lacks feature column(s) {absent}; columns are: {', '.join(table.column_names)}")
        blocks = [self._encode(table, column) for column in self.columns]
        x = np.concatenate(blocks, axis=1) if blocks else np.zeros((table.num_rows, 0))
        if self.mean is not None:
            x = (x - np.asarray(self.mean)) / np.asarray(self.std)
        return x.astype(np.float32)

    def _encode(self, table: pa.Table, column: EncodedColumn) -> np.ndarray:
        if column.kind == "onehot":
            return one_hot(category_values(table, column.name), column.categories or [])
        block = numeric_block(table, column.name)
        if block.shape[1] != column.width:
            raise DataError(
                f"feature column {column.name!r} has {block.shape[1]} values per row, expected {column.width}"
            )
        gaps = np.isnan(block)
        if gaps.any():
            if column.fill is None:
                raise missing_error(column.name, int(gaps.any(axis=1).sum()), table.num_rows)
            block = np.where(gaps, np.asarray(column.fill), block)
        return block


def scale_decision(values: np.ndarray) -> tuple[bool, str]:
    """Whether ``auto`` standardises numeric training values ``(N, k)`` (features, or a regression
    target as one column), and why, in words."""
    std = values.std(axis=0)
    varying = std > 0
    if not varying.any():
        return False, "every numeric feature is constant"
    rms = np.sqrt((values[:, varying] ** 2).mean(axis=0))
    low, high = float(std[varying].min()), float(std[varying].max())
    if high / low > _UNIT_SCALE:
        return True, f"feature standard deviations range from {low:.3g} to {high:.3g}"
    if rms.max() > _UNIT_SCALE or rms.min() < 1 / _UNIT_SCALE:
        return True, f"feature magnitudes (root-mean-square) range from {rms.min():.3g} to {rms.max():.3g}"
    return False, "features are already on a unit scale"


def standardization(values: np.ndarray, standardize: Standardize, *, tabular: bool = True) -> tuple[bool, str]:
    """Whether ``data.standardize`` z-scores these training values ``(N, k)``, and why in words: ``True``
    and ``False`` as set, ``"auto"`` by :func:`scale_decision` for tabular data, never for images and
    token ids."""
    if standardize != "auto":
        return bool(standardize), f"data.standardize: {str(standardize).lower()}"
    return scale_decision(values) if tabular else (False, "images and token ids keep their scale")


def fit_encoder(
    train: pa.Table,
    columns: list[str],
    *,
    standardize: Standardize = "auto",
    categorical: Categorical = "error",
    missing: Missing = "error",
    tabular: bool = True,
) -> FeatureEncoder:
    """Fit the feature transform on the training split's raw ``columns``.

    Numbers (or lists of numbers) pass through; text columns, and booleans under
    ``categorical="onehot"``, are one-hot encoded over the training categories
    (``categorical="error"`` refuses text columns). ``missing="mean"`` fills missing numbers with
    the training mean; ``"error"`` refuses them. ``standardize``: ``True`` z-scores every numeric
    value with the training mean and std (one-hot values stay 0/1), ``False`` never, ``"auto"``
    only for ``tabular`` data whose numeric features are not already on a unit scale (images and
    token ids are never standardised: pass ``tabular=False``).
    """
    encoded: list[EncodedColumn] = []
    numeric: list[np.ndarray] = []
    is_numeric: list[np.ndarray] = []
    for name in columns:
        arrow_type = train.schema.field(name).type
        if _is_text(arrow_type) and categorical == "error":
            raise text_column_error(name, arrow_type)
        if is_categorical(arrow_type, categorical):
            categories = sorted({v for v in category_values(train, name) if v is not None})
            encoded.append(EncodedColumn(name, "onehot", len(categories), categories=categories))
            is_numeric.append(np.zeros(len(categories), dtype=bool))
            continue
        block = numeric_block(train, name)
        column = EncodedColumn(name, "numeric", block.shape[1])
        gaps = np.isnan(block)
        if missing == "mean":
            counts = (~gaps).sum(axis=0)
            means = np.where(gaps, 0.0, block).sum(axis=0) / np.maximum(counts, 1)  # 0 where all are missing
            column.fill = means.tolist()
            block = np.where(gaps, means, block)
        elif gaps.any():
            raise missing_error(name, int(gaps.any(axis=1).sum()), train.num_rows)
        encoded.append(column)
        numeric.append(block)
        is_numeric.append(np.ones(block.shape[1], dtype=bool))
    encoder = FeatureEncoder(encoded, standardize=standardize)
    values = np.concatenate(numeric, axis=1) if numeric else np.zeros((train.num_rows, 0))
    apply, encoder.reason = standardization(values, standardize, tabular=tabular)
    if apply and values.shape[1]:
        mask = np.concatenate(is_numeric)
        mean, std = np.zeros(mask.size), np.ones(mask.size)
        mean[mask] = values.mean(axis=0)
        spread = values.std(axis=0)
        std[mask] = np.where(spread > 0, spread, 1.0)
        encoder.mean, encoder.std = mean.tolist(), std.tolist()
    return encoder
