"""The loader of the ``wine`` source: scikit-learn's wine table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import BaseModel

from mergeflow.data.loader import Loaded, SourceLoader
from mergeflow.data.rows import classification_info, make_dataset


def load_wine_source() -> Loaded:
    """The sklearn wine set (178 rows, 13 raw features, 3 classes)."""
    from sklearn.datasets import load_wine

    bunch = load_wine()
    ds = make_dataset(bunch.data, bunch.target.astype(np.int64))
    names = [str(n) for n in bunch.target_names]
    return ds, classification_info("wine", 3, [13], names)


class WineLoader(SourceLoader):
    """Reads the wine table; it takes no options."""

    def load(self, options: BaseModel, *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        return load_wine_source()
