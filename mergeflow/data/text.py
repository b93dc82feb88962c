"""Text sources: any ``datasets`` table with a text column (or a sentence pair), and WordNet.

Loaders return ``(dataset, info)`` like the numeric sources, with string columns ``"text"``
(and ``"text_pair"`` for sentence-pair tasks) in place of ``"x"``, int64 class ids in ``"y"``
and optionally ``"group"``. The ``tokenize`` step turns them into token ids
(:mod:`mergeflow.data.tokenize`). No corpus text ships with mergeflow: WordNet is read at run
time from a local database.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from mergeflow.data.sources import DataError, _labels, _missing_column, load_table, wrap_table

if TYPE_CHECKING:  # datasets loads where it is used: planning a run does not need it
    import datasets

# Where a WordNet database is looked for when none is configured: Debian's wordnet-base, then nltk_data.
WORDNET_ROOTS = ("/usr/share/wordnet", "~/nltk_data/corpora/wordnet", "/usr/share/nltk_data/corpora/wordnet")
WORDNET_POS = {"noun": "n", "verb": "v", "adj": "a", "adv": "r"}
_WORDNET_FILES = ("data.noun", "index.noun")
# The lexicographer files of WordNet 3.0, numbered as in lexnames(5WN). nltk's reader needs a
# ``lexnames`` file, which Debian's wordnet-base does not install.
LEXNAMES = (
    "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute noun.body "
    "noun.cognition noun.communication noun.event noun.feeling noun.food noun.group noun.location "
    "noun.motive noun.object noun.person noun.phenomenon noun.plant noun.possession noun.process "
    "noun.quantity noun.relation noun.shape noun.state noun.substance noun.time verb.body verb.change "
    "verb.cognition verb.communication verb.competition verb.consumption verb.contact verb.creation "
    "verb.emotion verb.motion verb.perception verb.possession verb.social verb.stative verb.weather adj.ppl"
).split()
_POS_NUMBER = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}


def _text_column(raw: datasets.Dataset, column: str, option: str) -> pa.Array:
    if column not in raw.column_names:
        raise _missing_column(f"data.text.{option}", column, list(raw.column_names))
    kind = option.removesuffix("_column").replace("_", " ")
    values = raw.data.column(column).combine_chunks()
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        raise DataError(f"{kind} column {column!r} has type {values.type}; it must hold strings")
    if values.null_count:
        raise DataError(f"{kind} column {column!r} has missing values")
    return values.cast(pa.string())


def make_text_dataset(
    texts: list[str] | pa.Array,
    labels: np.ndarray,
    *,
    pairs: list[str] | pa.Array | None = None,
    groups: list[str] | None = None,
) -> datasets.Dataset:
    """An in-memory dataset in the text layout: ``text`` (``text_pair``), ``y`` and ``group``."""
    columns: dict[str, pa.Array] = {"text": pa.array(texts, type=pa.string())}
    if pairs is not None:
        columns["text_pair"] = pa.array(pairs, type=pa.string())
    columns["y"] = pa.array(np.asarray(labels, dtype=np.int64))
    if groups is not None:
        columns["group"] = pa.array([str(g) for g in groups], type=pa.string())
    return wrap_table(pa.table(columns))


def load_text_source(
    path: str,
    *,
    name: str | None = None,
    data_files: str | list[str] | dict | None = None,
    split: str = "train",
    text_column: str = "text",
    text_pair_column: str | None = None,
    label_column: str = "label",
    group_column: str | None = None,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """A text classification table read with ``datasets.load_dataset``.

    ``path`` is a builder (``csv``, ``json``, ``parquet``) with local ``data_files``, or a hub
    dataset name (needs network). ``text_pair_column`` makes it a sentence-pair task (NLI-style).
    String or non-contiguous labels map to ``0..C-1`` in sorted order.
    """
    raw = load_table(path, name=name, data_files=data_files, split=split)
    if label_column not in raw.column_names:
        raise _missing_column("data.text.label_column", label_column, list(raw.column_names))
    texts = _text_column(raw, text_column, "text_column")
    pairs = _text_column(raw, text_pair_column, "text_pair_column") if text_pair_column else None
    groups = None
    if group_column is not None:
        if group_column not in raw.column_names:
            raise _missing_column("data.text.group_column", group_column, list(raw.column_names))
        groups = [str(g) for g in raw.data.column(group_column).to_pylist()]
    y, class_names = _labels(raw.data.table, label_column, "classification", raw.features[label_column])
    num_classes = len(class_names) if class_names else int(y.max()) + 1
    info = _text_info(f"text:{path}", num_classes, class_names, pair=pairs is not None)
    return make_text_dataset(texts, y, pairs=pairs, groups=groups), info


def _text_info(source: str, num_classes: int, class_names: list[str] | None, *, pair: bool) -> dict[str, Any]:
    return {
        "source": source,
        "modality": "text",
        "task": "classification",
        "num_classes": int(num_classes),
        "class_names": class_names,
        "pair": pair,
        "input_shape": None,  # set by the tokenize step: [max_length]
    }


def find_wordnet(root: str | None = None) -> Path:
    """The directory of a WordNet database (``data.noun``, ``index.noun``, ``lexnames``, …).

    Raises:
        DataError: saying how to get one, when none is found.
    """
    candidates = [root] if root else list(WORDNET_ROOTS)
    for candidate in candidates:
        directory = Path(candidate).expanduser()
        if all((directory / name).is_file() for name in _WORDNET_FILES):
            return directory
    where = f"{root} has no" if root else f"none of {', '.join(WORDNET_ROOTS)} has"
    raise DataError(
        f"no WordNet database found: {where} data.noun and index.noun. Install one with "
        "'apt-get install wordnet-base' (Debian/Ubuntu), or online with "
        "python -c \"import nltk; nltk.download('wordnet')\", or set data.wordnet.root to its directory"
    )


@contextmanager
def _wordnet_reader(directory: Path) -> Iterator[Any]:
    """nltk's reader over ``directory``, through a copy with a ``lexnames`` file when it lacks one."""
    import warnings

    import nltk
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    class Reader(WordNetCorpusReader):
        def map_wn(self, version: str = "wordnet") -> None:
            # nltk maps any other database to its own downloaded copy, for multilingual look-ups only.
            return None

    with tempfile.TemporaryDirectory(prefix="wordnet-") as overlay, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The multilingual functions are not available")
        # nltk reads only below the roots in nltk.data.path (its path sandbox): authorise these two.
        roots = [str(directory.resolve()), str(Path(overlay).resolve())]
        nltk.data.path.extend(roots)
        try:
            if (directory / "lexnames").is_file():
                yield Reader(str(directory), None)
                return
            # Copies, not links: the sandbox refuses a link that leaves the reader's root.
            for name in WordNetCorpusReader._FILES:
                if (directory / name).is_file():
                    shutil.copyfile(directory / name, Path(overlay) / name)
            lines = [f"{i:02d}\t{name}\t{_POS_NUMBER[name.split('.')[0]]}\n" for i, name in enumerate(LEXNAMES)]
            (Path(overlay) / "lexnames").write_text("".join(lines))
            yield Reader(overlay, None)
        finally:
            for root in roots:
                nltk.data.path.remove(root)


# What a synset can be described by: its definition, a usage example, or the names (lemmas) of its own or
# related synsets, e.g. dog.n.01 by "canine, canid" (hypernyms) or "corgi, poodle, ..." (hyponyms).
WORDNET_TEXTS: dict[str, Callable[[Any], str]] = {
    "definition": lambda s: s.definition(),
    "example": lambda s: "; ".join(s.examples()[:2]),
    "synonyms": lambda s: _names([s]),
    "hypernyms": lambda s: _names(s.hypernyms()),
    "hyponyms": lambda s: _names(s.hyponyms()),
    "siblings": lambda s: _names([h for parent in s.hypernyms()[:1] for h in parent.hyponyms() if h != s]),
    "parts": lambda s: _names(s.part_meronyms() + s.member_meronyms() + s.substance_meronyms()),
    "wholes": lambda s: _names(s.part_holonyms() + s.member_holonyms() + s.substance_holonyms()),
    "derived": lambda s: _names([d.synset() for lemma in s.lemmas() for d in lemma.derivationally_related_forms()]),
}
_MAX_NAMES = 12  # a hyponym or sibling list can run to hundreds of names


def _names(synsets: list[Any]) -> str:
    """The lemma names of ``synsets``, in order, without repeats, underscores as spaces."""
    names = dict.fromkeys(lemma.name().replace("_", " ") for synset in synsets for lemma in synset.lemmas())
    return ", ".join(list(names)[:_MAX_NAMES])


def load_wordnet_source(
    root: str | None = None,
    pos: list[str] | tuple[str, ...] = ("noun", "verb"),
    max_examples: int | None = None,
    texts: list[str] | tuple[str, ...] = ("definition",),
    group: str = "pos",
    seed: int = 0,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """WordNet synsets labelled with their supersense (lexicographer file, e.g. ``noun.animal``).

    Every synset of the chosen parts of speech gives at most one example: its gloss (definition) by
    default. With several kinds of ``texts`` (keys of :data:`WORDNET_TEXTS`), each is a domain over the
    same labels, as genres are in MNLI: every kind gets an equal share of the synsets that have such a
    text (the rarest kinds are filled first), each synset described once. ``group`` is each row's part of
    speech (``pos``) or its kind of text (``text``). Read with nltk's WordNet reader from a local database
    (:func:`find_wordnet`). ``max_examples`` keeps a seeded random subset.
    """
    selection = _wordnet_selection(root, tuple(pos), tuple(texts), max_examples, seed)
    rows = selection.rows
    groups = [selection.parts[i] for i, _ in rows] if group == "pos" else [kind for _, kind in rows]
    supersenses = [selection.lexnames[i] for i, _ in rows]
    class_names = sorted(set(supersenses))
    index = {name: i for i, name in enumerate(class_names)}
    labels = np.array([index[s] for s in supersenses], dtype=np.int64)
    info = _text_info("wordnet", len(class_names), class_names, pair=False)
    return make_text_dataset([selection.described[kind][i] for i, kind in rows], labels, groups=groups), info


def load_wordnet_corpus(
    count: int,
    root: str | None = None,
    pos: list[str] | tuple[str, ...] = ("noun", "verb"),
    max_examples: int | None = None,
    texts: list[str] | tuple[str, ...] = ("definition",),
    seed: int = 0,
) -> list[str]:
    """Unlabelled text for language-model pre-training: the definitions of up to ``count`` synsets (of the
    same parts of speech) that :func:`load_wordnet_source` with the same options did not pick, so the
    corpus holds no synset of the task, not even described another way. Seeded."""
    selection = _wordnet_selection(root, tuple(pos), tuple(texts), max_examples, seed)
    taken = {i for i, _ in selection.rows}
    free = [i for i, gloss in enumerate(selection.described_definitions) if gloss and i not in taken]
    chosen = np.random.default_rng([seed, 1]).permutation(free)[:count]
    return [selection.described_definitions[i] for i in sorted(chosen.tolist())]


@dataclass(frozen=True)
class _Selection:
    parts: list[str]
    lexnames: list[str]
    described: dict[str, list[str]]
    described_definitions: list[str]
    rows: list[tuple[int, str]]


@lru_cache(maxsize=1)  # the task and its corpus come from one read of the database
def _wordnet_selection(
    root: str | None, pos: tuple[str, ...], texts: tuple[str, ...], max_examples: int | None, seed: int
) -> _Selection:
    unknown = [p for p in pos if p not in WORDNET_POS]
    if unknown or not pos:
        raise DataError(f"wordnet pos must be a non-empty list of {', '.join(WORDNET_POS)}; got {list(pos)}")
    wrong = [t for t in texts if t not in WORDNET_TEXTS]
    if wrong or not texts or len(set(texts)) != len(texts):
        raise DataError(f"wordnet texts must be distinct kinds of {', '.join(WORDNET_TEXTS)}; got {list(texts)}")
    with _wordnet_reader(find_wordnet(root)) as reader:
        synsets = [(part, s) for part in pos for s in reader.all_synsets(WORDNET_POS[part])]
        described = {kind: [WORDNET_TEXTS[kind](s) for _, s in synsets] for kind in texts}
        definitions = described.get("definition") or [s.definition() for _, s in synsets]
        lexnames = [s.lexname() for _, s in synsets]
    if not synsets or not any(any(values) for values in described.values()):
        raise DataError(f"the WordNet database at {find_wordnet(root)} has no {list(texts)} for {list(pos)}")
    rows = _assign_kinds(described, np.random.default_rng(seed), max_examples)
    return _Selection([part for part, _ in synsets], lexnames, described, definitions, rows)


def _assign_kinds(
    described: dict[str, list[str]], rng: np.random.Generator, max_examples: int | None
) -> list[tuple[int, str]]:
    """``(synset index, kind)`` rows: each synset at most once, the kinds in equal shares as far as
    their synsets allow, rarest kind first; in synset order."""
    available = {kind: np.flatnonzero([bool(t) for t in values]) for kind, values in described.items()}
    if len(available) == 1:
        ((kind, indices),) = available.items()
        if max_examples is not None and max_examples < len(indices):
            indices = indices[np.sort(rng.choice(len(indices), size=max_examples, replace=False))]
        return [(int(i), kind) for i in indices]
    total = len(set().union(*(set(v.tolist()) for v in available.values())))
    budget = total if max_examples is None else min(max_examples, total)
    used: set[int] = set()
    rows: list[tuple[int, str]] = []
    kinds = sorted(available, key=lambda kind: len(available[kind]))
    for position, kind in enumerate(kinds):
        share = (budget - len(rows)) // (len(kinds) - position)
        free = [i for i in rng.permutation(available[kind]).tolist() if i not in used]
        chosen = free[:share]
        used.update(chosen)
        rows += [(i, kind) for i in chosen]
    return sorted(rows)
