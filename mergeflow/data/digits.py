"""The loader of the ``digits`` source: scikit-learn's 8x8 digits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import BaseModel

from mergeflow.data.loader import Loaded, SourceLoader
from mergeflow.data.rows import classification_info, make_dataset


def load_digits_source() -> Loaded:
    """The sklearn 8x8 digits (1797 images, 10 classes), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    ds = make_dataset(bunch.data / 16.0, bunch.target.astype(np.int64))
    names = [str(c) for c in range(10)]
    return ds, classification_info("digits", 10, [1, 8, 8], names) | {"class_values": list(range(10))}


class DigitsLoader(SourceLoader):
    """Reads the digits; they take no options."""

    def load(self, options: BaseModel, *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        return load_digits_source()
