"""Fortune cookies labelled with their genre, from the fortune files (loader: :mod:`mergeflow.data.fortunes`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mergeflow.schema.data_source import DataSource, Modality, register_source

FORTUNES_ROOT = "/usr/share/games/fortunes"


class FortunesOptions(BaseModel):
    """Fortunes → their genre (the file that holds them: ``computers``, ``people``, …), read from the
    fortune program's data files (strfile format, entries separated by ``%`` lines; Debian's ``fortunes``
    package installs them in ``root``). ``genres``: the files to read, by name; none: the ``largest``
    genres by number of entries kept. ``min_words``/``max_words``: entries outside are dropped, not cut.
    ``max_examples`` keeps a seeded random subset."""

    model_config = ConfigDict(extra="forbid")

    root: str = FORTUNES_ROOT
    genres: list[str] | None = Field(None, min_length=2)
    largest: int = Field(5, ge=2)
    max_examples: int | None = Field(None, ge=10)
    min_words: int = Field(3, ge=1)
    max_words: int = Field(60, ge=1)

    @field_validator("genres")
    @classmethod
    def _distinct(cls, genres: list[str] | None) -> list[str] | None:
        if genres is not None and len(set(genres)) != len(genres):
            raise ValueError("a genre is listed twice")
        return genres


@register_source
class Fortunes(DataSource):
    """Fortune cookies labelled with their genre, from the fortune program's local data files."""

    name = "fortunes"
    Options = FortunesOptions
    implementation = "mergeflow.data.fortunes:FortunesLoader"
    reads_disk = True
    likely_causes = ("genres whose fortunes read alike (data.fortunes.genres)",)

    def modality(self, options: FortunesOptions) -> Modality:
        return "tokens"

    def check_options(self, options: FortunesOptions) -> None:
        if options.max_words < options.min_words:
            raise ValueError(f"{self.name}.max_words: {options.max_words} is below min_words ({options.min_words})")
