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


TINY = {
    "bert": {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 64},
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2},
}  # fmt: skip


def tokenized_topics(directory: Path, rows: int = 200, vocab_size: int = 300, max_length: int = 20):
    """The topic CSV as a text dataset, its info, a BPE tokenizer trained on it, and token ids and labels."""
    from mergeflow.data.storage import to_arrays
    from mergeflow.data.text import load_text_source
    from mergeflow.data.tokenize import encode_dataset, train_tokenizer, training_texts

    path = write_topic_csv(directory / "topics.csv", rows=rows)
    ds, info = load_text_source("csv", data_files=str(path), text_column="sentence", label_column="topic")
    tokenizer = train_tokenizer(training_texts(ds), vocab_size=vocab_size)
    layout = {"input_shape": [max_length], "task": "classification"}
    X, y = to_arrays(encode_dataset(ds, tokenizer, max_length), layout)
    return ds, info, tokenizer, X, y


def tiny_transformer(arch: str, *, seed: int = 0, num_labels: int = 4, task: str = "sequence_classification"):
    """A 2-layer, 32-wide BERT or GPT-2 from config over a 300-token vocabulary (padding id 0), and its spec."""
    from mergeflow.models.hf import build_base

    return build_base(
        pretrained=None,
        config=TINY[arch],
        num_labels=num_labels,
        vocab_size=300,
        max_length=20,
        pad_token_id=0,
        sep_token_id=None,
        dropout=0.0,
        seed=seed,
        task=task,
    )
