"""The loader of the ``wordnet`` source: WordNet synsets labelled with their supersense, read at run time
from a local database with nltk's reader (no corpus text ships with mergeflow), in the text layout
(:func:`mergeflow.data.rows.make_text_dataset`)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from mergeflow.data.errors import DataError
from mergeflow.data.loader import Loaded, SourceLoader
from mergeflow.data.rows import make_text_dataset, text_info
from mergeflow.errors import MergeflowError
from mergeflow.schema.sources.wordnet import WordNetOptions

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
) -> Loaded:
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
    info = text_info("wordnet", len(class_names), class_names, pair=False)
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


class WordNetLoader(SourceLoader):
    """Reads WordNet from its local database; its corpus is other synsets' definitions."""

    def load(self, options: WordNetOptions, *, seed: int = 0, data: Mapping[str, Any] | None = None) -> Loaded:
        return load_wordnet_source(**options.model_dump(exclude={"corpus_examples"}), seed=seed)

    def corpus(self, options: WordNetOptions, *, seed: int = 0) -> list[str]:
        if options.corpus_examples == 0:
            return []
        rest = options.model_dump(exclude={"corpus_examples", "group"})
        return load_wordnet_corpus(options.corpus_examples, **rest, seed=seed)

    def preflight(self, options: WordNetOptions) -> list[str]:
        try:
            find_wordnet(options.root)
        except MergeflowError as error:
            return [f"data.wordnet.root: {error}"]
        return []
