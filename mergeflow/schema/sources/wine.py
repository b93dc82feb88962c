"""The scikit-learn wine table (loader: :mod:`mergeflow.data.wine`)."""

from __future__ import annotations

from typing import Any

from mergeflow.schema.data_source import DataSource, register_source

WINE_ROWS = 178


@register_source
class Wine(DataSource):
    """The scikit-learn wine table: 178 rows, 13 features, 3 classes."""

    name = "wine"
    implementation = "mergeflow.data.wine:WineLoader"

    def known_rows(self, options: Any) -> int:
        return WINE_ROWS
