"""A data source that the repository does not have, as a contributor adds one: its declaration module and
its loader module, written into a copy of the code tree (``tests/test_adding_data_source.py``,
``tests/test_import_graph.py``)."""

from __future__ import annotations

from pathlib import Path

DECLARATION = "mergeflow/schema/sources/blobs.py"
LOADER = "mergeflow/data/blobs.py"

FILES = {
    DECLARATION: '''"""Gaussian blobs in the plane (loader: :mod:`mergeflow.data.blobs`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from mergeflow.schema.data_source import DataSource, register_source


class BlobsOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int = Field(300, ge=10)
    classes: int = Field(3, ge=2)
    spread: float = Field(0.5, gt=0)


@register_source
class Blobs(DataSource):
    """Gaussian blobs in the plane; the class is the blob."""

    name = "blobs"
    Options = BlobsOptions
    implementation = "mergeflow.data.blobs:BlobsLoader"

    def known_rows(self, options: BlobsOptions) -> int:
        return options.n
''',
    LOADER: '''"""The loader of the ``blobs`` source."""

from __future__ import annotations

import numpy as np

from mergeflow.data.loader import SourceLoader
from mergeflow.data.rows import classification_info, make_dataset


class BlobsLoader(SourceLoader):
    def load(self, options, *, seed=0, data=None):
        rng = np.random.default_rng(seed)
        y = np.arange(options.n) % options.classes
        x = rng.normal(0.0, 3.0, (options.classes, 2))[y] + options.spread * rng.standard_normal((options.n, 2))
        return make_dataset(x, y.astype(np.int64)), classification_info("blobs", options.classes, [2], None)
''',
}


def add_blobs(code_root: Path) -> None:
    """Write the blobs source's two modules into the code tree at ``code_root``."""
    for name, text in FILES.items():
        (code_root / name).write_text(text)
