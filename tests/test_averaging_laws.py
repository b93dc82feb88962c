"""The parameter-averaging-laws reproduction: its smoke version end to end, the centralized model at its best
validation epoch, WordNet's kinds of text as domains, and the analysis against hand computations."""

from __future__ import annotations

import csv
import json
import random
import time
from pathlib import Path

import pytest
import yaml
from conftest import run_cli
from text_fixtures import TINY, TOPICS, WORDNET_ENTRIES, write_wordnet

# Three domains over the same four topics: each has its own filler words, as genres have their own style.
_DOMAIN_FILLERS = {
    "news": "reported officials said today according statement".split(),
    "forum": "lol anyone know thanks guys imho btw".split(),
    "recipe": "stir mix minutes heat until serve".split(),
}


def _write_domains_csv(path: Path, rows: int = 360, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["sentence", "topic", "domain"])
        writer.writeheader()
        for i in range(rows):
            domain = sorted(_DOMAIN_FILLERS)[i % 3]
            topic = rng.choice(sorted(TOPICS))
            words = [rng.choice(TOPICS[topic]) for _ in range(rng.randint(2, 4))]
            words += [rng.choice(_DOMAIN_FILLERS[domain]) for _ in range(rng.randint(3, 8))]
            rng.shuffle(words)
            writer.writerow({"sentence": " ".join(words), "topic": topic, "domain": domain})
    return path


def _smoke_preset(tmp_path: Path) -> Path:
    data = _write_domains_csv(tmp_path / "domains.csv")
    preset = {
        "seeds": [0],
        "settings": {
            "iid": {"partition.method": "iid"},
            # the IID run's centralized model is the reference for every setting: no need to train it again
            "non-iid": {"partition.method": "natural", "centralized.enabled": False},
            "seen-unseen": {"partition.method": "natural", "federated.fraction": 0.34},
        },
        "models": {
            "tiny": {
                "params": {"model.transformers.config": {**TINY["bert"], "hidden_size": 16, "intermediate_size": 32}}
            },
            "small": {"params": {"model.transformers.config": TINY["bert"], "pretrain.language_model.epochs": 2}},
            "published": {"package": "no_such_model_package_here", "tokens": 1e9},
        },
        "vocabulary": ["tiny", "small"],
        "params": {
            "data": {
                "source": "text",
                "text": {
                    "path": "csv",
                    "data_files": str(data),
                    "text_column": "sentence",
                    "label_column": "topic",
                    "group_column": "domain",
                },
                "test_fraction": 0.25,
                "server_fraction": 0.0,
                "validation_fraction": 0.15,
                "tokenizer": {"vocab_size": 200, "max_length": 16},
            },  # fmt: skip
            "partition": {"method": "iid", "num_clients": 3},
            "model": {"arch": "transformers", "transformers": {"config": TINY["bert"]}},
            "pretrain": {"enabled": False, "language_model": {"text": "train", "epochs": 1, "lr": 0.001}},
            "finetune": {"epochs": 0, "lr": 0.003, "optimizer": "adam"},
            "centralized": {"epochs": 3, "keep": "best_validation"},
            "merge": {"methods": []},
            "federated": {
                "algorithms": ["fedavg"],
                "rounds": 2,
                "local": {"epochs": 1, "lr": 0.003, "optimizer": "adam"},
                "predictive_samples": 0,
            },
            "orchestration": {"max_workers": 1},
            "tracking": {"log_models": False},
        },
    }
    path = tmp_path / "averaging_laws.yaml"  # its stem names the results
    path.write_text(yaml.safe_dump(preset))
    return path


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, cli_env):
    """The smoke sweep (one seed, two models, tiny data) through the CLI, and its seconds."""
    root = tmp_path_factory.mktemp("laws")
    preset = _smoke_preset(root)
    started = time.perf_counter()
    done = run_cli(["reproduce", "averaging-laws", "--preset", str(preset)], root, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    return root, preset, time.perf_counter() - started


@pytest.mark.slow
def test_the_smoke_sweep_tables_gain_gap_and_seen_unseen_under_a_minute(smoke):
    from mergeflow.federated import sample_participants
    from tasks.layout import client_file
    from tasks.prepared import read_groups

    root, _, seconds = smoke
    assert seconds < 60
    table = (root / "results/averaging_laws.md").read_text()
    assert "| model | iid | non-iid | seen-unseen | gap iid − non-iid |" in table
    assert "FedAvg unseen" in table and (root / "results/averaging_laws.png").stat().st_size > 0
    assert "published: left out, its package 'no_such_model_package_here' is not installed" in table
    assert "| setting | tiny (vocabulary " in table  # the vocabulary pair's table
    data = json.loads((root / "results/averaging_laws.json").read_text())
    runs = {(r["model"], r["setting"]): r for r in data["runs"]}
    assert len(runs) == 6
    gains = table.split("### Accuracy gain")[1].split("###")[0]
    header = [cell.strip() for cell in gains.splitlines()[2].split("|")]
    for model in ("tiny", "small"):  # one centralized model per model and seed: the IID run's, whatever the partition
        row = next(line for line in gains.splitlines() if line.startswith(f"| {model} |"))
        cell = [c.strip() for c in row.split("|")][header.index("non-iid")]
        gain = runs[(model, "non-iid")]["federated"] - runs[(model, "iid")]["centralized"]
        assert cell == f"{100 * gain:.2f} ± 0.00"
        assert runs[(model, "non-iid")]["centralized"] is None  # centralized.enabled: false trained none
    # Seen domains are those of the clients sampled in some round (one client per domain, 1 of 3 a round).
    sampled = {k for r in range(2) for k in sample_participants(3, 0.34, 0, r)}
    workspace = root / "results/averaging_laws-workspace"
    domain_of = {k: read_groups(workspace / client_file(k))[0] for k in range(3)}  # the last run: seen-unseen
    assert set(domain_of.values()) == set(_DOMAIN_FILLERS)
    assert set(runs[("small", "seen-unseen")]["seen_domains"]) == {domain_of[k] for k in sampled}
    # N excludes embeddings and the head; tokens are counted: twice the epochs, twice the tokens.
    facts = data["models"]
    assert 0 < facts["tiny"]["parameters"] < facts["small"]["parameters"]
    assert facts["small"]["tokens"] == 2 * facts["tiny"]["tokens"] > 0
    assert facts["small"]["compute"] == pytest.approx(6 * facts["small"]["parameters"] * facts["small"]["tokens"])


@pytest.mark.slow
def test_a_second_sweep_reads_its_records_and_the_bulky_blobs_are_gone(smoke, cli_env):
    from tasks.store import ArtifactStore, sha256_file

    root, preset, seconds = smoke
    workspace = root / "results/averaging_laws-workspace"
    store = ArtifactStore(workspace)
    assert store.blob(sha256_file(workspace / "models/base/base.safetensors")).is_file()
    message = next((workspace / "models/federated").rglob("*.message.safetensors"))
    assert not store.blob(sha256_file(message)).exists()  # per-round checkpoints: dropped after each model
    last_run = (workspace / ".mergeflow/last_run.json").stat().st_mtime_ns
    table = (root / "results/averaging_laws.md").read_text()
    started = time.perf_counter()
    done = run_cli(["reproduce", "averaging-laws", "--preset", str(preset)], root, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (workspace / ".mergeflow/last_run.json").stat().st_mtime_ns == last_run  # no pipeline run at all
    assert (root / "results/averaging_laws.md").read_text() == table
    assert time.perf_counter() - started < seconds / 2


@pytest.mark.slow
def test_the_centralized_model_is_its_best_validation_epoch(smoke):
    from mergeflow.checkpoints import load_checkpoint_meta

    root, _, _ = smoke
    meta = load_checkpoint_meta(root / "results/averaging_laws-workspace/models/centralized/centralized.safetensors")
    accuracies = [epoch["accuracy"] for epoch in meta["validation_curve"]]
    assert len(accuracies) == 3 and meta["split"] == "validation"
    assert meta["best_epoch"] == accuracies.index(max(accuracies)) + 1


def test_wordnet_kinds_of_text_are_domains_in_equal_shares_each_synset_once(tmp_path):
    from mergeflow.data.wordnet import load_wordnet_source

    root = write_wordnet(tmp_path / "wordnet")
    ds, info = load_wordnet_source(str(root), texts=["definition", "synonyms"], group="text")
    assert ds["group"].count("definition") == ds["group"].count("synonyms") == 3
    word_of = {gloss: word for entries in WORDNET_ENTRIES.values() for _, word, gloss in entries}
    described = [word_of.get(text, text) for text in ds["text"]]  # a synonyms row's text is the word itself
    assert sorted(described) == sorted(word_of.values())  # every synset once, by one kind of text
    labels = dict(zip(described, (info["class_names"][y] for y in ds["y"]), strict=True))
    assert labels["dog"] == "noun.animal" and labels["walk"] == "verb.motion"


def test_gain_seen_unseen_and_correlations_match_hand_computations():
    from mergeflow.reproductions.averaging_laws import (
        ModelFacts,
        RunResult,
        correlations,
        gains,
        per_domain,
        seen_unseen,
    )

    runs = [
        RunResult("a", "iid", 0, federated=0.50, centralized=0.60),
        RunResult("a", "non-iid", 0, federated=0.40, centralized=0.55),
        RunResult("b", "iid", 0, federated=0.70, centralized=0.65),
        RunResult("c", "iid", 0, federated=0.90, centralized=0.80),
        RunResult("a", "su", 0, 0.0, 0.0, {"x": 0.2, "y": 0.4, "z": 0.9}, {"x": 0.3, "y": 0.5, "z": 0.6}, ("x", "y")),
    ]
    gain = gains([r for r in runs if r.setting != "su"], "iid")
    assert gain[("a", "non-iid", 0)] == pytest.approx(0.40 - 0.60)  # against the IID run's centralized model
    runs[0] = RunResult("a", "iid", 0, 0.50, 0.60, centralized_by_domain={"x": 0.3, "y": 0.5, "z": 0.6})
    cells = seen_unseen(runs, "su", "iid")["a"]  # the centralized model is the reference (iid) run's
    assert cells["federated_seen"] == [pytest.approx(0.3)] and cells["centralized_unseen"] == [pytest.approx(0.6)]
    assert cells["centralized_seen"] == [pytest.approx(0.4)] and "federated_unseen" in cells
    assert per_domain(runs, "su", "iid")[2] == ["a", "z", "0 of 1", "", "+30.0"]
    facts = {m: ModelFacts(m, n, 1e3, "counted", 100) for m, n in (("a", 10), ("b", 100), ("c", 1000))}
    values = correlations(facts, gain, "iid", ["a", "b", "c"])
    assert values["spearman"] == [pytest.approx(1.0)] and 0.9 < values["pearson"][0] <= 1.0


def test_the_wordnet_corpus_holds_the_definitions_of_synsets_outside_the_task(tmp_path):
    from mergeflow.data.wordnet import load_wordnet_corpus, load_wordnet_source
    from mergeflow.schema.sources import get_source

    options = {"root": str(write_wordnet(tmp_path / "wordnet")), "texts": ["synonyms"], "max_examples": 3}
    task, _ = load_wordnet_source(**options, seed=1)
    corpus = load_wordnet_corpus(10, **options, seed=1)
    gloss_of = {word: gloss for entries in WORDNET_ENTRIES.values() for _, word, gloss in entries}
    assert sorted(corpus) == sorted(gloss for word, gloss in gloss_of.items() if word not in task["text"])
    wordnet = get_source("wordnet")
    assert len(corpus) == 3 and wordnet.loader.corpus(wordnet.parse({"root": options["root"]}), seed=1) == []


def test_corpus_pretraining_and_best_epoch_need_what_they_read(tmp_path):
    from mergeflow.config import validate_params
    from mergeflow.errors import ConfigError

    root = str(write_wordnet(tmp_path / "wordnet"))
    base = {"data": {"source": "wordnet", "wordnet": {"root": root}}, "model": {"arch": "transformers"}}
    corpus = {**base, "pretrain": {"language_model": {"text": "corpus"}}}
    with pytest.raises(ConfigError, match="corpus_examples"):
        validate_params(corpus, "test")
    corpus["data"]["wordnet"]["corpus_examples"] = 100
    assert validate_params(corpus, "test").data.wordnet.corpus_examples == 100
    with pytest.raises(ConfigError, match="validation_fraction"):
        validate_params({**base, "centralized": {"keep": "best_validation"}}, "test")


def test_the_masked_lm_head_on_masked_positions_only_gives_the_full_heads_losses(monkeypatch):
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from mergeflow.models import language_model
    from mergeflow.models.hf import SequenceClassifier

    config = AutoConfig.for_model(**TINY["bert"], vocab_size=120, max_position_embeddings=32, num_labels=3)
    ids = torch.randint(5, 120, (64, 12), generator=torch.Generator().manual_seed(0))
    ids[::3, 9:] = 0  # some padding
    special = language_model.SpecialIds(pad=0, mask=4, never_masked=(1, 2, 3))

    def losses() -> list[float]:
        torch.manual_seed(0)
        model = SequenceClassifier(AutoModelForSequenceClassification.from_config(config), 0, None, False)
        return language_model.pretrain_language_model(model, ids, special, objective="mlm", epochs=2, lr=1e-3)

    fast = losses()
    monkeypatch.setattr(language_model._MaskedPositionsHead, "install", classmethod(lambda cls, lm: None))
    assert fast == pytest.approx(losses(), rel=1e-5)
