"""The data-source protocol and its registry: what a source is, by name, for params and for stages.

A source is one :class:`DataSource` subclass registered with :func:`register_source`. Its class
attributes and the methods that take its validated options (``task``, ``modality``, ``group_column``,
``known_rows``, ``data_files``, ``corpus_size``, ``check_options``) are pure: the params schema
calls them, so they import nothing heavy and read no file. The methods that read data (``load``,
``load_raw``, ``corpus``, ``check``, ``preflight``) take the options as plain JSON (the dumped
``data.<name>`` section, as a step's params hold it) and import their loader inside the function,
so that ``mergeflow validate`` imports neither torch, ``datasets``, scikit-learn nor nltk.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from mergeflow.errors import ConfigError, did_you_mean, first_problem
from mergeflow.schema.deprecation import deprecated

if TYPE_CHECKING:
    import datasets

    from mergeflow.data.sources import RawData

    Loaded = tuple[datasets.Dataset, dict[str, Any]]

Modality = Literal["features", "image", "tokens"]
LabelTask = Literal["classification", "regression"]


class NoOptions(BaseModel):
    """Options of a source that takes none."""

    model_config = ConfigDict(extra="forbid")


class DataSource:
    """A data source: its name, options section ``data.<name>``, facts about its rows, and its loaders."""

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    Options: ClassVar[type[BaseModel]] = NoOptions
    user_table: ClassVar[bool] = False
    """Whether it reads the user's own table: read once before any work (``check``), files hashed."""
    likely_causes: ClassVar[tuple[str, ...]] = ()
    """Why a model may stay at the input-blind baseline on this source (the evaluation's sanity warning)."""
    shape_option: ClassVar[str | None] = None
    """The option that can give its rows an image shape when loaded (``model.arch: cnn`` then passes)."""

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
        """How many unlabelled texts :meth:`corpus` gives (``pretrain.language_model.text: corpus``)."""
        return 0

    def check_options(self, options: Any) -> None:
        """Rules across its options that the options model alone cannot say; ValueError ``key: why``."""

    def load(self, options: Mapping[str, Any], *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        """``(dataset, info)`` in the ``x``/``y``/``group`` layout (``text``/``y``/``group`` for text);
        ``data`` is the whole ``data`` section, for the policies (``missing``, ``categorical``)."""
        raise NotImplementedError(f"data source {self.name!r} has no loader")

    def load_raw(self, options: Mapping[str, Any], *, seed: int = 0, data: Mapping[str, Any] | None = None) -> RawData:
        """Numeric rows before feature encoding: by default the loaded ``x`` column as one raw feature."""
        from mergeflow.data.sources import raw_from_dataset

        return raw_from_dataset(*self.load(options, seed=seed, data=data))

    def corpus(self, options: Mapping[str, Any], *, seed: int = 0) -> list[str]:
        """Unlabelled text for the tokenizer and language-model pre-training (none by default)."""
        return []

    def check(self, options: Mapping[str, Any], *, seed: int = 0, data: Mapping[str, Any] | None = None) -> None:
        """Read the user's table as the prepare step will, raising its ``DataError`` now (``user_table``)."""
        self.load(options, seed=seed, data=data)

    def preflight(self, options: Any) -> list[str]:
        """Problems with what the options point at on disk, each ``data.<name>.<key>: why``: by default the
        local ``data_files`` that do not exist."""
        missing = [f for f in local_files(self.data_files(options)) if not Path(f).is_file()]
        return [f"data.{self.name}.data_files: file not found: {f}" for f in missing]


SOURCES: dict[str, DataSource] = {}
ALIASES: dict[str, str] = {}


def register_source(cls: type[DataSource]) -> type[DataSource]:
    """Class decorator: register one instance of ``cls`` under ``cls.name`` and its aliases."""
    taken = [n for n in (cls.name, *cls.aliases) if n in SOURCES or n in ALIASES]
    if taken:
        raise ValueError(f"data source name {taken[0]!r} is registered twice")
    if cls.Options.model_config.get("extra") != "forbid":
        raise ValueError(f"options of data source {cls.name!r} must forbid extra keys")
    SOURCES[cls.name] = cls()
    ALIASES.update(dict.fromkeys(cls.aliases, cls.name))
    return cls


def canonical_name(name: str) -> str:
    """The registered name for ``name`` or one of its aliases (the first use of an alias prints a notice).

    Raises:
        ValueError: for an unknown name.
    """
    if name in SOURCES:
        return name
    if name in ALIASES:
        new = ALIASES[name]
        deprecated(f"data.source {name!r} is now {new!r} (and data.{name} is data.{new})")
        return new
    raise ValueError(f"unknown data source {name!r}{did_you_mean(name, SOURCES)}; known: {', '.join(SOURCES)}")


def get_source(name: str) -> DataSource:
    """The registered source ``name`` (or an alias of it).

    Raises:
        ConfigError: for an unknown name.
    """
    try:
        return SOURCES[canonical_name(name)]
    except ValueError as error:
        raise ConfigError([f"data.source: {error}"]) from None


def files_listed(data_files: str | list[str] | dict[str, str | list[str]] | None) -> list[str]:
    """``data_files`` (a name, a list, or lists by split) as one flat list."""
    if data_files is None:
        return []
    if isinstance(data_files, dict):
        return [f for value in data_files.values() for f in files_listed(value)]
    return [data_files] if isinstance(data_files, str) else list(data_files)


def local_files(names: list[str]) -> list[str]:
    """The plain local paths among ``names`` (URLs and glob patterns are left to ``datasets``)."""
    return [f for f in names if "://" not in f and not any(c in f for c in "*?[")]
