"""WordNet synsets labelled with their supersense (loader: :mod:`mergeflow.data.wordnet`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mergeflow.schema.data_source import DataSource, Modality, register_source

WordNetText = Literal[
    "definition", "example", "synonyms", "hypernyms", "hyponyms", "siblings", "parts", "wholes", "derived"
]


class WordNetOptions(BaseModel):
    """WordNet synsets → supersense (``noun.animal``, ``verb.motion``, …), read from a local database.
    ``root`` None looks in /usr/share/wordnet (Debian's wordnet-base) and nltk_data. ``texts``: what
    describes a synset (its definition by default); several kinds are domains over the same labels,
    in equal shares, each synset described once. ``group``: each row's part of speech or kind of text
    (what ``partition.method: natural`` and the per-group test metrics use). ``corpus_examples``:
    definitions of as many other synsets, unlabelled, as a corpus for the tokenizer and for language-model
    pre-training (``pretrain.language_model.text: corpus``); none of them is a synset of the task."""

    model_config = ConfigDict(extra="forbid")

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
    implementation = "mergeflow.data.wordnet:WordNetLoader"
    reads_disk = True

    def modality(self, options: WordNetOptions) -> Modality:
        return "tokens"

    def group_column(self, options: WordNetOptions) -> str:
        return options.group

    def corpus_size(self, options: WordNetOptions) -> int:
        return options.corpus_examples
