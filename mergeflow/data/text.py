"""The loader of the ``text`` source: the user's text classification table (or sentence pairs), read with
``datasets.load_dataset``.

It loads into the text layout (:func:`mergeflow.data.rows.make_text_dataset`): string columns ``"text"``
(and ``"text_pair"`` for sentence-pair tasks), int64 class ids in ``"y"`` and optionally ``"group"``. The
``tokenize`` step turns them into token ids (:mod:`mergeflow.data.tokenize`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from mergeflow.data.errors import DataError
from mergeflow.data.loader import Loaded, SourceLoader
from mergeflow.data.rows import make_text_dataset, text_info
from mergeflow.data.table import labels, load_table, missing_column
from mergeflow.schema.sources.text import TextOptions

if TYPE_CHECKING:  # datasets loads where it is used: planning a run does not need it
    import datasets


def _text_column(raw: datasets.Dataset, column: str, option: str) -> pa.Array:
    if column not in raw.column_names:
        raise missing_column(f"data.text.{option}", column, list(raw.column_names))
    kind = option.removesuffix("_column").replace("_", " ")
    values = raw.data.column(column).combine_chunks()
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        raise DataError(f"{kind} column {column!r} has type {values.type}; it must hold strings")
    if values.null_count:
        raise DataError(f"{kind} column {column!r} has missing values")
    return values.cast(pa.string())


def load_text_source(
    path: str,
    *,
    name: str | None = None,
    data_files: str | list[str] | dict | None = None,
    split: str = "train",
    text_column: str = "text",
    text_pair_column: str | None = None,
    label_column: str = "label",
    group_column: str | None = None,
) -> Loaded:
    """A text classification table read with ``datasets.load_dataset``.

    ``path`` is a builder (``csv``, ``json``, ``parquet``) with local ``data_files``, or a hub
    dataset name (needs network). ``text_pair_column`` makes it a sentence-pair task (NLI-style).
    String or non-contiguous labels map to ``0..C-1`` in sorted order.
    """
    raw = load_table(path, name=name, data_files=data_files, split=split)
    if label_column not in raw.column_names:
        raise missing_column("data.text.label_column", label_column, list(raw.column_names))
    texts = _text_column(raw, text_column, "text_column")
    pairs = _text_column(raw, text_pair_column, "text_pair_column") if text_pair_column else None
    groups = None
    if group_column is not None:
        if group_column not in raw.column_names:
            raise missing_column("data.text.group_column", group_column, list(raw.column_names))
        groups = [str(g) for g in raw.data.column(group_column).to_pylist()]
    y, class_names = labels(raw.data.table, label_column, "classification", raw.features[label_column])
    num_classes = len(class_names) if class_names else int(y.max()) + 1
    info = text_info(f"text:{path}", num_classes, class_names, pair=pairs is not None)
    return make_text_dataset(texts, y, pairs=pairs, groups=groups), info


class TextLoader(SourceLoader):
    """Reads the user's text table."""

    def load(self, options: TextOptions, *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        return load_text_source(**options.model_dump())
