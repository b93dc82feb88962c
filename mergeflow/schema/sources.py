"""The built-in data sources, declared: their options sections (``data.<name>``) and facts.

Torch-free and without I/O, as the rest of ``mergeflow.schema``: each source's loader is in
``mergeflow.data`` (``sources`` for the numeric ones, ``text`` for text), imported inside the
method that uses it. A new source is one loader module plus one class here (or anywhere, for a
notebook) registered with :func:`register_source`; see ``docs/architecture.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mergeflow.schema.data_source import (
    ALIASES,
    SOURCES,
    DataSource,
    LabelTask,
    Modality,
    NoOptions,
    canonical_name,
    get_source,
    register_source,
)

if TYPE_CHECKING:
    from mergeflow.data.sources import RawData
    from mergeflow.schema.data_source import Loaded

__all__ = ["ALIASES", "SOURCES", "DataSource", "NoOptions", "canonical_name", "get_source", "register_source"]

DIGITS_ROWS = 1797
WINE_ROWS = 178


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


@register_source
class Digits(DataSource):
    """The scikit-learn 8x8 digits: 1797 images, 10 classes."""

    name = "digits"

    def modality(self, options: Any) -> Modality:
        return "image"

    def known_rows(self, options: Any) -> int:
        return DIGITS_ROWS

    def load(self, options: Mapping[str, Any], *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        from mergeflow.data.sources import load_digits_source

        return load_digits_source()


@register_source
class Wine(DataSource):
    """The scikit-learn wine table: 178 rows, 13 features, 3 classes."""

    name = "wine"

    def known_rows(self, options: Any) -> int:
        return WINE_ROWS

    def load(self, options: Mapping[str, Any], *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        from mergeflow.data.sources import load_wine_source

        return load_wine_source()


class PinwheelOptions(_Options):
    clusters: int = Field(5, ge=2)
    per_cluster: int = Field(1000, ge=1)
    radial_std: float = Field(0.3, gt=0)
    tangential_std: float = Field(0.05, gt=0)
    rate: float = 0.25


@register_source
class Pinwheel(DataSource):
    """The synthetic 2-D pinwheel; a class is an arm."""

    name = "pinwheel"
    Options = PinwheelOptions

    def known_rows(self, options: PinwheelOptions) -> int:
        return options.clusters * options.per_cluster

    def load(self, options: Mapping[str, Any], *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        from mergeflow.data.sources import make_pinwheel

        return make_pinwheel(**self.parse(options).model_dump(), seed=seed)


class LinregOptions(_Options):
    n: int = Field(1000, ge=2)
    dim: int = Field(10, ge=1)
    noise_std: float = Field(0.5, gt=0)
    prior_std: float = Field(1.0, gt=0)


@register_source
class Linreg(DataSource):
    """Synthetic Bayesian linear regression with known truth."""

    name = "linreg"
    Options = LinregOptions

    def task(self, options: LinregOptions) -> LabelTask:
        return "regression"

    def known_rows(self, options: LinregOptions) -> int:
        return options.n

    def load(self, options: Mapping[str, Any], *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        from mergeflow.data.sources import make_linreg

        return make_linreg(**self.parse(options).model_dump(), seed=seed)


DataFiles = str | list[str] | dict[str, str | list[str]] | None


class TableOptions(_Options):
    """Any ``datasets.load_dataset`` source: local csv/parquet/json files, or a hub name when online."""

    path: str | None = None
    name: str | None = None
    data_files: DataFiles = None
    split: str = "train"
    feature_columns: list[str] | None = None
    label_column: str = "label"
    task: Literal["classification", "regression"] = "classification"
    group_column: str | None = None
    input_shape: list[int] | None = None


def _needs_path(name: str, options: Any) -> None:
    if not options.path:
        raise ValueError(f"{name}.path: source {name!r} needs it (e.g. 'csv' with data.{name}.data_files)")


@register_source
class Table(DataSource):
    """The user's own table of numeric (or one-hot encoded) features, read with ``datasets``."""

    name = "table"
    aliases = ("hf",)
    Options = TableOptions
    user_table = True
    likely_causes = ("a label column that is not the target (data.table.label_column)",)
    shape_option = "input_shape"

    def task(self, options: TableOptions) -> LabelTask:
        return options.task

    def modality(self, options: TableOptions) -> Modality:
        return "image" if options.input_shape is not None and len(options.input_shape) > 1 else "features"

    def check_options(self, options: TableOptions) -> None:
        _needs_path(self.name, options)

    def load(self, options: Mapping[str, Any], *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        from mergeflow.data.sources import load_table_source

        return load_table_source(**_table_options(self.parse(options), data))

    def load_raw(self, options: Mapping[str, Any], *, seed: int = 0, data: Mapping[str, Any] | None = None) -> RawData:
        from mergeflow.data.sources import load_table_raw

        return load_table_raw(**_table_options(self.parse(options), data))

    def check(self, options: Mapping[str, Any], *, seed: int = 0, data: Mapping[str, Any] | None = None) -> None:
        self.load_raw(options, seed=seed, data=data)


def _table_options(options: TableOptions, data: Mapping[str, Any] | None) -> dict[str, Any]:
    """A table's options with the data section's policies for missing values and text columns."""
    policies = {key: (data or {}).get(key, "error") for key in ("missing", "categorical")}
    return options.model_dump() | policies


class TextOptions(_Options):
    """A text classification table for ``datasets.load_dataset``: local csv/json/parquet, or a hub name
    when online. ``text_pair_column`` makes it a sentence-pair task (NLI-style)."""

    path: str | None = None
    name: str | None = None
    data_files: DataFiles = None
    split: str = "train"
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    group_column: str | None = None


@register_source
class Text(DataSource):
    """The user's own text classification table (or sentence pairs), tokenized before partitioning."""

    name = "text"
    Options = TextOptions
    user_table = True
    likely_causes = ("a label column that is not the target (data.text.label_column)",)

    def modality(self, options: TextOptions) -> Modality:
        return "tokens"

    def check_options(self, options: TextOptions) -> None:
        _needs_path(self.name, options)

    def load(self, options: Mapping[str, Any], *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        from mergeflow.data.text import load_text_source

        return load_text_source(**self.parse(options).model_dump())


WordNetText = Literal[
    "definition", "example", "synonyms", "hypernyms", "hyponyms", "siblings", "parts", "wholes", "derived"
]


class WordNetOptions(_Options):
    """WordNet synsets → supersense (``noun.animal``, ``verb.motion``, …), read from a local database.
    ``root`` None looks in /usr/share/wordnet (Debian's wordnet-base) and nltk_data. ``texts``: what
    describes a synset (its definition by default); several kinds are domains over the same labels,
    in equal shares, each synset described once. ``group``: each row's part of speech or kind of text
    (what ``partition.method: natural`` and the per-group test metrics use). ``corpus_examples``:
    definitions of as many other synsets, unlabelled, as a corpus for the tokenizer and for language-model
    pre-training (``pretrain.language_model.text: corpus``); none of them is a synset of the task."""

    root: str | None = None
    pos: list[Literal["noun", "verb", "adj", "adv"]] = ["noun", "verb"]
    max_examples: int | None = Field(None, ge=10)
    texts: list[WordNetText] = Field(["definition"], min_length=1)
    group: Literal["pos", "text"] = "pos"
    corpus_examples: int = Field(0, ge=0)

    @field_validator("texts")
    @classmethod
    def _distinct(cls, texts: list[str]) -> list[str]:
        if len(set(texts)) != len(texts):
            raise ValueError("a kind of text is listed twice")
        return texts


@register_source
class WordNet(DataSource):
    """WordNet synsets labelled with their supersense, from a local database."""

    name = "wordnet"
    Options = WordNetOptions

    def modality(self, options: WordNetOptions) -> Modality:
        return "tokens"

    def group_column(self, options: WordNetOptions) -> str:
        return options.group

    def corpus_size(self, options: WordNetOptions) -> int:
        return options.corpus_examples

    def load(self, options: Mapping[str, Any], *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        from mergeflow.data.text import load_wordnet_source

        chosen = self.parse(options).model_dump(exclude={"corpus_examples"})
        return load_wordnet_source(**chosen, seed=seed)

    def corpus(self, options: Mapping[str, Any], *, seed: int = 0) -> list[str]:
        from mergeflow.data.text import load_wordnet_corpus

        chosen = self.parse(options)
        if chosen.corpus_examples == 0:
            return []
        rest = chosen.model_dump(exclude={"corpus_examples", "group"})
        return load_wordnet_corpus(chosen.corpus_examples, **rest, seed=seed)

    def preflight(self, options: WordNetOptions) -> list[str]:
        from mergeflow.data.text import find_wordnet
        from mergeflow.errors import MergeflowError

        try:
            find_wordnet(options.root)
        except MergeflowError as error:
            return [f"data.wordnet.root: {error}"]
        return []
