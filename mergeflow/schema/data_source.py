"""What a data source is, for params and for stages: the :class:`DataSource` declaration and its registry.

A source is one :class:`DataSource` subclass registered with :func:`register_source`, plus the loader
its ``implementation`` names (``"module:attr"``, a :class:`mergeflow.data.loader.SourceLoader`). The
declaration's class attributes and the methods that take its validated options (``task``, ``modality``,
``group_column``, ``known_rows``, ``data_files``, ``corpus_size``, ``check_options``) are pure: the params
schema calls them, so they import nothing heavy and read no file, and name the loader only as a string.
Reading data and checking what the options point at on disk is the loader's (:attr:`DataSource.loader`),
so that ``mergeflow validate`` imports neither torch, ``datasets``, scikit-learn nor nltk, and a step that
reads one source is keyed by that source's modules only (:attr:`DataSource.modules`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ValidationError

from mergeflow.errors import first_problem
from mergeflow.registry import Member, Registry

Modality = Literal["features", "image", "tokens"]
LabelTask = Literal["classification", "regression"]
DataFiles = str | list[str] | dict[str, str | list[str]] | None


class DataSource(Member):
    """A data source: its name, options section ``data.<name>``, facts about its rows, and its loader."""

    user_table: ClassVar[bool] = False
    """Whether it reads the user's own table: read once before any work (``check``), files hashed."""
    likely_causes: ClassVar[tuple[str, ...]] = ()
    """Why a model may stay at the input-blind baseline on this source (the evaluation's sanity warning)."""
    shape_option: ClassVar[str | None] = None
    """The option that can give its rows an image shape when loaded (``model.arch: cnn`` then passes)."""
    reads_disk: ClassVar[bool] = False
    """Whether its options name files or a database on this machine, which :meth:`preflight` checks."""

    def parse(self, options: Mapping[str, Any] | BaseModel | None = None) -> BaseModel:
        """The validated options model from a ``data.<name>`` section (a mapping, a model or None).

        Raises:
            ValueError: ``<name>.<key>: why``, for the first invalid key.
        """
        if isinstance(options, self.Options):
            return options
        try:
            return self.Options.model_validate(dict(options or {}))
        except ValidationError as error:
            raise ValueError(first_problem(self.name, error)) from None

    @property
    def loader(self) -> Any:
        """Its :class:`~mergeflow.data.loader.SourceLoader`, bound to it (its module imported now)."""
        return self.load()(self)

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules that key a step that reads it: its declaration's and its loader's."""
        return tuple(dict.fromkeys(m for m in (type(self).__module__, self.module) if m))

    def task(self, options: Any) -> LabelTask:
        """What the labels are."""
        return "classification"

    def modality(self, options: Any) -> Modality:
        """What a row is: numeric features, an image-shaped array, or text that is tokenized."""
        return "features"

    def group_column(self, options: Any) -> str | None:
        """The column that names each row's group (``partition.method: natural``), if any."""
        return getattr(options, "group_column", None)

    def known_rows(self, options: Any) -> int | None:
        """How many rows it yields, when known without reading anything."""
        return None

    def data_files(self, options: Any) -> list[str]:
        """The files it reads, as named (local paths, glob patterns or URLs): they key the prepare step."""
        return files_listed(getattr(options, "data_files", None))

    def corpus_size(self, options: Any) -> int:
        """How many unlabelled texts its loader's ``corpus`` gives (``pretrain.language_model.text: corpus``)."""
        return 0

    def check_options(self, options: Any) -> None:
        """Rules across its options that the options model alone cannot say; ValueError ``key: why``."""

    def preflight(self, options: Any) -> list[str]:
        """Problems with what the options point at on disk, each ``data.<name>.<key>: why``: its loader's
        ``preflight``, for a source that ``reads_disk`` (the others' loaders are not imported)."""
        return self.loader.preflight(options) if self.reads_disk else []


SOURCES: Registry[DataSource] = Registry(
    "data source", "data.source", notice="{key} {old!r} is now {new!r} (and data.{old} is data.{new})"
)
"""The registered sources by name, complete once :mod:`mergeflow.schema.sources` is imported."""


def register_source(cls: type[DataSource]) -> type[DataSource]:
    """Class decorator: register one instance of ``cls`` under ``cls.name`` and its aliases.

    Raises:
        ValueError: when a name is taken, or when its ``Options`` accept extra keys.
    """
    SOURCES.declare(cls())
    return cls


def files_listed(data_files: DataFiles) -> list[str]:
    """``data_files`` (a name, a list, or lists by split) as one flat list."""
    if data_files is None:
        return []
    if isinstance(data_files, dict):
        return [f for value in data_files.values() for f in files_listed(value)]
    return [data_files] if isinstance(data_files, str) else list(data_files)


def require_path(name: str, options: Any) -> None:
    """The ``check_options`` of a source read with ``datasets.load_dataset``: its ``path`` is set.

    Raises:
        ValueError: ``<name>.path: why``.
    """
    if not options.path:
        raise ValueError(f"{name}.path: source {name!r} needs it (e.g. 'csv' with data.{name}.data_files)")
