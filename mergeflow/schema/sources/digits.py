"""The scikit-learn 8x8 digits (loader: :mod:`mergeflow.data.digits`)."""

from __future__ import annotations

from typing import Any

from mergeflow.schema.data_source import DataSource, Modality, register_source

DIGITS_ROWS = 1797


@register_source
class Digits(DataSource):
    """The scikit-learn 8x8 digits: 1797 images, 10 classes."""

    name = "digits"
    implementation = "mergeflow.data.digits:DigitsLoader"

    def modality(self, options: Any) -> Modality:
        return "image"

    def known_rows(self, options: Any) -> int:
        return DIGITS_ROWS
