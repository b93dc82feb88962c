"""The loader of the ``fortunes`` source: fortune cookies labelled with their genre, read at run time from the
fortune program's data files (no fortune text ships with mergeflow), in the text layout
(:func:`mergeflow.data.rows.make_text_dataset`).

A genre is one file of the directory whose name has no ``.`` (Debian's ``fortunes`` package installs each
beside its strfile index ``<genre>.dat`` and a ``<genre>.u8`` link, which are not read); its entries are
separated by lines holding only ``%``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mergeflow.data.errors import DataError
from mergeflow.data.loader import Loaded, SourceLoader
from mergeflow.data.rows import make_text_dataset, text_info
from mergeflow.schema.sources.fortunes import FortunesOptions

_SEPARATOR = re.compile(r"^%\r?$", re.MULTILINE)
_INSTALL = "install them with 'apt-get install fortunes' (Debian/Ubuntu) or set data.fortunes.root"


def genre_files(root: str) -> dict[str, Path]:
    """The genre files of ``root`` by name, sorted.

    Raises:
        DataError: saying how to get some, when ``root`` holds none.
    """
    directory = Path(root).expanduser()
    found = sorted(p for p in directory.iterdir() if p.is_file() and "." not in p.name) if directory.is_dir() else []
    if not found:
        raise DataError(f"no fortune files in {root}: {_INSTALL}")
    return {path.name: path for path in found}


def _overstruck(text: str) -> str:
    """``text`` as printed: each backspace erases the character before it (fortune files underline and
    embolden words by overstriking, e.g. ``____\\b\\b\\b\\bthis``)."""
    kept: list[str] = []
    for char in text:
        if char == "\b":
            if kept:
                kept.pop()
        else:
            kept.append(char)
    return "".join(kept)


def read_fortunes(path: Path, min_words: int, max_words: int) -> list[str]:
    """The entries of one fortune file with ``min_words``..``max_words`` words, in file order, as printed and
    on one line (runs of white space as one space)."""
    text = _overstruck(path.read_bytes().decode("utf-8", errors="replace"))
    entries = (" ".join(entry.split()) for entry in _SEPARATOR.split(text))
    return [entry for entry in entries if min_words <= len(entry.split()) <= max_words]


def load_fortunes_source(
    root: str,
    genres: list[str] | None = None,
    largest: int = 5,
    max_examples: int | None = None,
    min_words: int = 3,
    max_words: int = 60,
    seed: int = 0,
) -> Loaded:
    """Fortunes labelled with their genre (class names: the genres, sorted).

    ``genres`` names the files to read; without it, the ``largest`` genres by number of entries kept (ties
    by name). Rows are in genre then file order; ``max_examples`` keeps a seeded random subset of them.
    """
    files = genre_files(root)
    unknown = [g for g in genres or [] if g not in files]
    if unknown:
        raise DataError(f"no fortune genre {unknown[0]!r} in {root} (its genres: {', '.join(files)})")
    read = {name: files[name] for name in genres} if genres else files
    kept = {name: read_fortunes(path, min_words, max_words) for name, path in read.items()}
    chosen = sorted(genres or sorted(kept, key=lambda name: (-len(kept[name]), name))[:largest])
    empty = [genre for genre in chosen if not kept[genre]]
    if empty:
        raise DataError(f"fortune genre {empty[0]!r} has no entry of {min_words}..{max_words} words")
    texts = [entry for genre in chosen for entry in kept[genre]]
    labels = np.array([k for k, genre in enumerate(chosen) for _ in kept[genre]], dtype=np.int64)
    if max_examples is not None and max_examples < len(texts):
        rows = np.sort(np.random.default_rng(seed).choice(len(texts), size=max_examples, replace=False))
        texts, labels = [texts[i] for i in rows], labels[rows]
    return make_text_dataset(texts, labels), text_info("fortunes", len(chosen), chosen, pair=False)


class FortunesLoader(SourceLoader):
    """Reads the fortune program's data files."""

    def load(self, options: FortunesOptions, *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        return load_fortunes_source(**options.model_dump(), seed=seed)

    def preflight(self, options: FortunesOptions) -> list[str]:
        try:
            files = genre_files(options.root)
        except DataError as error:
            return [f"data.fortunes.root: {error}"]
        unknown = [g for g in options.genres or [] if g not in files]
        return [f"data.fortunes.genres: no genre {g!r} in {options.root}" for g in unknown[:1]]
