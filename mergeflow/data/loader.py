"""How a source's rows are read: the :class:`SourceLoader` that a source's ``implementation`` names.

A loader is bound to its declaration (:attr:`mergeflow.schema.data_source.DataSource.loader`) and its
methods take the validated options model (``DataSource.parse``) and, where the source reads them, the
``data`` section's policies (``missing``, ``categorical``). A loader module imports what it reads with;
it is imported only when its source is used, and only the steps that read its source are keyed by it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mergeflow.data.rows import RawData, raw_from_dataset

if TYPE_CHECKING:
    import datasets
    from pydantic import BaseModel

    from mergeflow.schema.data_source import DataSource

Loaded = tuple["datasets.Dataset", dict[str, Any]]


class SourceLoader(ABC):
    """The code that reads one source: ``load`` is its own (a loader without one cannot be made); the others
    have defaults."""

    def __init__(self, source: DataSource) -> None:
        self.source = source

    @abstractmethod
    def load(self, options: BaseModel, *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        """``(dataset, info)`` in the ``x``/``y``/``group`` layout (``text``/``y``/``group`` for text);
        ``seed`` drives the synthetic sources, ``data`` is the ``data`` section (its policies)."""

    def load_raw(self, options: BaseModel, *, seed: int = 0, data: Mapping[str, Any] | None = None) -> RawData:
        """Numeric rows before feature encoding: by default the loaded ``x`` column as one raw feature."""
        return raw_from_dataset(*self.load(options, seed=seed, data=data))

    def corpus(self, options: BaseModel, *, seed: int = 0) -> list[str]:
        """Unlabelled text for the tokenizer and language-model pre-training (none by default)."""
        return []

    def check(self, options: BaseModel, *, seed: int = 0, data: Mapping[str, Any] | None = None) -> None:
        """Read the user's table as the prepare step will, raising its ``DataError`` now (``user_table``)."""
        self.load(options, seed=seed, data=data)

    def preflight(self, options: BaseModel) -> list[str]:
        """Problems with what the options point at on disk, each ``data.<name>.<key>: why``: by default the
        local ``data_files`` that do not exist."""
        named = self.source.data_files(options)
        missing = [f for f in local_files(named) if not Path(f).is_file()]
        return [f"data.{self.source.name}.data_files: file not found: {f}" for f in missing]


def local_files(names: list[str]) -> list[str]:
    """The plain local paths among ``names`` (URLs and glob patterns are left to ``datasets``)."""
    return [f for f in names if "://" not in f and not any(c in f for c in "*?[")]
