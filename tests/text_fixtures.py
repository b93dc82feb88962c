"""Small text data the tests write themselves: a topic-classification CSV and a tiny WordNet database."""

from __future__ import annotations

import csv
import random
from pathlib import Path

TOPICS = {
    "animal": "dog cat horse bird fish wolf tiger rabbit mouse whale".split(),
    "weather": "rain snow wind storm cloud sunny cold fog thunder heat".split(),
    "food": "bread cheese apple soup rice pasta cake salad meat butter".split(),
    "sport": "football tennis goal team match score player race coach ball".split(),
}
FILLER = "the a of and in on with very some many this that it is was".split()


def write_topic_csv(path: Path, rows: int = 600, seed: int = 0) -> Path:
    """Sentences of topic words among filler words (columns sentence, topic, genre), learnable but not trivial:
    2 to 5 topic words among 3 to 12 fillers, lengths that vary."""
    rng = random.Random(seed)
    records = []
    for _ in range(rows):
        topic = rng.choice(sorted(TOPICS))
        words = [rng.choice(TOPICS[topic]) for _ in range(rng.randint(2, 5))]
        words += [rng.choice(FILLER) for _ in range(rng.randint(3, 12))]
        rng.shuffle(words)
        records.append({"sentence": " ".join(words), "topic": topic, "genre": rng.choice(["news", "forum"])})
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["sentence", "topic", "genre"])
        writer.writeheader()
        writer.writerows(records)
    return path


# (lexicographer file number, word, gloss) per part of speech: the numbers follow lexnames(5WN).
WORDNET_ENTRIES = {
    "noun": [(5, "dog", "a domesticated carnivorous mammal"), (5, "cat", "a small feline kept as a pet"),
             (13, "bread", "food made from dough of flour and water"), (28, "noon", "the middle of the day")],
    "verb": [(38, "walk", "use the feet to advance"), (34, "eat", "take in solid food")],
}  # fmt: skip
_DATA_SUFFIX = {"noun": "noun", "verb": "verb", "adj": "adj", "adv": "adv"}
_SS_TYPE = {"noun": "n", "verb": "v"}


def write_wordnet(directory: Path) -> Path:
    """A WordNet database in the wndb(5WN) format with the entries above and no ``lexnames`` file (as
    Debian's wordnet-base installs it): data files with byte offsets, index files, empty exception files."""
    directory.mkdir(parents=True, exist_ok=True)
    header = "  1 A tiny WordNet-format database written by the tests.  \n"
    for pos in _DATA_SUFFIX.values():
        (directory / f"index.{pos}").write_text(header)
        (directory / f"{pos}.exc").write_text("")
        (directory / f"data.{pos}").write_text(header)
    for pos, entries in WORDNET_ENTRIES.items():
        text, index = header, header
        for lexfile, word, gloss in entries:
            offset = len(text.encode())
            frames = " 01 + 02 00" if pos == "verb" else ""
            text += f"{offset:08d} {lexfile:02d} {_SS_TYPE[pos]} 01 {word} 0 000{frames} | {gloss}  \n"
            index += f"{word} {_SS_TYPE[pos]} 1 0 1 0 {offset:08d}  \n"
        (directory / f"data.{pos}").write_text(text)
        (directory / f"index.{pos}").write_text(header + "".join(sorted(index.splitlines(True)[1:])))
    return directory
