"""The ``data`` and ``partition`` sections: the source and its options, its splits, how clients split it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mergeflow.config.section import Section
from mergeflow.errors import did_you_mean
from mergeflow.schema.data_source import Modality
from mergeflow.schema.sources import SOURCES, DataSource, canonical_name


class TokenizerConfig(Section):
    """Tokenization of text sources. A pretrained model (``model.transformers.pretrained``) brings its own
    tokenizer; otherwise a byte-level BPE tokenizer of ``vocab_size`` is trained on the training
    split (``tokenizers``' WordPiece trainer is not reproducible run to run). Inputs are cut or
    padded to ``max_length`` tokens."""

    kind: Literal["bpe"] = "bpe"
    vocab_size: int = Field(8192, ge=100)
    min_frequency: int = Field(2, ge=1)
    max_length: int = Field(64, ge=1)


class DataConfig(Section):
    """The data source (``source``, any registered one: :mod:`mergeflow.schema.sources`), its splits and
    feature policies. A source's options are the section ``data.<name>``, validated by its options model;
    the chosen source's (its defaults when left out) is :attr:`options`. Other sources' sections are kept
    only where given, so registering a source changes no params."""

    model_config = ConfigDict(extra="allow")  # the sources' sections, each checked by _source_sections
    source: str = "digits"
    test_fraction: float = Field(0.2, gt=0, lt=1)
    server_fraction: float = Field(0.1, ge=0, lt=1)
    validation_fraction: float = Field(0.0, ge=0, lt=1)
    standardize: Literal["auto", True, False] = "auto"
    categorical: Literal["error", "onehot"] = "error"
    missing: Literal["error", "drop_rows", "mean"] = "error"
    tokenizer: TokenizerConfig = TokenizerConfig()

    @model_validator(mode="before")
    @classmethod
    def _source_sections(cls, raw: Any) -> Any:
        """Old names to new ones (an old section's keys over the new one's), unknown keys refused, and the
        chosen source's section and every one given as its options model."""
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        if isinstance(raw.get("source"), str) and raw["source"] in SOURCES.aliases:
            raw["source"] = canonical_name(raw["source"])
        for old in [key for key in raw if key in SOURCES.aliases]:
            new, section = canonical_name(old), raw.pop(old)
            if isinstance(section, dict) and isinstance(raw.get(new), dict):
                section = raw[new] | section  # `-S data.hf.path=…` over a params file that says data.table
            raw[new] = section
        for key in raw:
            if key not in cls.model_fields and key not in SOURCES:
                raise ValueError(f"{key}: unknown key")
        chosen = raw.get("source", cls.model_fields["source"].default)
        return raw | {name: source.parse(raw.get(name)) for name, source in SOURCES.items() if name in (*raw, chosen)}

    def for_prepare(self) -> dict[str, Any]:
        """The section as the prepare step reads it, as JSON: the chosen source's options, the split fractions
        and, unless the source is text (tokenized, not encoded), the feature policies; no other source's
        options and no tokenizer (the tokenize step's)."""
        unread = {"tokenizer", *(name for name in SOURCES if name != self.source)}
        if self.is_text:
            unread |= {"standardize", "categorical", "missing"}
        return self.model_dump(mode="json", exclude=unread)

    @property
    def declaration(self) -> DataSource:
        """The chosen source (its declaration and loaders)."""
        return SOURCES[self.source]

    @property
    def options(self) -> BaseModel:
        """The chosen source's options (section ``data.<source>``)."""
        return getattr(self, self.source)

    @property
    def task(self) -> str:
        """What the labels are: ``classification`` or ``regression``, as the source says for its options."""
        return self.declaration.task(self.options)

    @property
    def modality(self) -> Modality:
        """What a row is: ``features``, ``image`` (image-shaped features) or ``tokens`` (tokenized text)."""
        return self.declaration.modality(self.options)

    @property
    def is_text(self) -> bool:
        """Whether the source is text (tokenized before partitioning)."""
        return self.modality == "tokens"

    @property
    def group_column(self) -> str | None:
        """The column that names each row's group, if the source has one."""
        return self.declaration.group_column(self.options)

    @field_validator("source")
    @classmethod
    def _registered(cls, source: str) -> str:
        if source not in SOURCES:
            raise ValueError(
                f"unknown data source {source!r}{did_you_mean(source, SOURCES)}; known: {', '.join(SOURCES)}"
            )
        return source

    @model_validator(mode="after")
    def _fractions_leave_training_data(self) -> DataConfig:
        if self.test_fraction + self.server_fraction + self.validation_fraction >= 0.95:
            raise ValueError(
                "test_fraction + server_fraction + validation_fraction must leave at least 5% for the clients"
            )
        self.declaration.check_options(self.options)
        if self.is_text and self.standardize is True:
            raise ValueError("standardize: text is tokenized, not standardized; set it to auto or false")
        return self


class PartitionConfig(Section):
    """How the training split is shared among the clients: ``iid`` (equal random shards), ``dirichlet`` (label skew
    with concentration ``alpha``), ``pathological`` (``classes_per_client`` classes each), ``natural`` (one client
    per group) or ``replicated`` (every client holds the whole training split: clients that differ only in how
    they are trained, as in the SSF paper's pinwheel; the centralized oracle then trains on the split once)."""

    method: Literal["iid", "dirichlet", "pathological", "natural", "replicated"] = "dirichlet"
    num_clients: int = Field(4, ge=1)
    alpha: float = Field(0.5, gt=0)
    classes_per_client: int = Field(2, ge=1)
    min_partition_size: int = Field(10, ge=0)

    @property
    def splits_rows(self) -> bool:
        """Whether the clients split the training rows between them (every method but ``replicated``)."""
        return self.method != "replicated"

    def pooled(self, local: int) -> bool:
        """Whether the centralized oracle trains on client ``local``'s data (index among its task's clients): every
        client's, the training split once, except with ``replicated``, where client 0 holds all of it."""
        return self.splits_rows or local == 0
