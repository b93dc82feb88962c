"""Text data, tokenizers and transformers models on their own: offline, on data the tests write."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from text_fixtures import TINY, tiny_transformer, tokenized_topics, write_topic_csv, write_wordnet

from mergeflow.data.errors import DataError
from mergeflow.data.storage import to_arrays
from mergeflow.data.text import load_text_source
from mergeflow.data.tokenize import encode_dataset, train_tokenizer, training_texts
from mergeflow.data.wordnet import load_wordnet_source
from mergeflow.fisher import diagonal_fisher
from mergeflow.merge import merge
from mergeflow.models import build_from_spec
from mergeflow.models.hf import build_base, save_pretrained
from mergeflow.training import minibatches, train


@pytest.fixture(scope="module")
def topics(tmp_path_factory):
    """The topic CSV as a text dataset, its info, a BPE tokenizer trained on it, and its token ids."""
    return tokenized_topics(tmp_path_factory.mktemp("text"))


def test_wordnet_glosses_are_labelled_with_their_supersense(tmp_path):
    root = write_wordnet(tmp_path / "wordnet")
    ds, info = load_wordnet_source(str(root))
    rows = dict(zip(ds["text"], (info["class_names"][y] for y in ds["y"]), strict=True))
    assert rows["a domesticated carnivorous mammal"] == "noun.animal"
    assert rows["use the feet to advance"] == "verb.motion"
    assert rows["take in solid food"] == "verb.consumption"
    assert ds["group"].count("verb") == 2 and info["modality"] == "text"
    only_nouns, _ = load_wordnet_source(str(root), pos=["noun"])
    assert only_nouns.num_rows == 4


def test_a_missing_wordnet_database_says_how_to_get_one(tmp_path):
    with pytest.raises(DataError, match="apt-get install wordnet-base.*nltk.download"):
        load_wordnet_source(str(tmp_path / "nowhere"))


def test_text_csv_maps_string_labels_and_names_a_missing_column(topics, tmp_path):
    ds, info, *_ = topics
    assert info["class_names"] == ["animal", "food", "sport", "weather"]
    assert set(ds.column_names) == {"text", "y"} and ds.num_rows == 200
    path = write_topic_csv(tmp_path / "t.csv", rows=20)
    with pytest.raises(DataError, match="data.text.text_column: no column 'body' in the table; columns: .*sentence"):
        load_text_source("csv", data_files=str(path), text_column="body", label_column="topic")


def test_a_trained_tokenizer_is_deterministic_pads_right_and_cuts_at_max_length(topics):
    ds = topics[0]
    first, second = (train_tokenizer(training_texts(ds), vocab_size=400) for _ in range(2))
    assert first.get_vocab() == second.get_vocab() and first.pad_token_id == 0
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    ids, _ = to_arrays(encode_dataset(ds, first, 8), {"input_shape": [8], "task": "classification"})
    assert ids.shape == (200, 8) and ids.dtype == np.int64
    lengths = (ids != 0).sum(1)
    assert lengths.max() == 8  # long sentences are cut
    short = ids[lengths < 8]
    assert all((row[n:] == 0).all() for row, n in zip(short, lengths[lengths < 8], strict=True))


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_padded_batches_give_the_logits_of_each_text_alone(topics, arch):
    X = torch.tensor(topics[3][:6])
    model, _ = tiny_transformer(arch)
    model.eval()
    batch = model(X)
    for row, ids in zip(batch, X, strict=True):
        alone = model.model(input_ids=ids[ids != 0][None]).logits[0]
        torch.testing.assert_close(row, alone, atol=1e-5, rtol=1e-5)


def test_a_spec_rebuilds_the_same_model_and_seeds_are_reproducible():
    model, spec = tiny_transformer("bert", seed=3)
    again, _ = tiny_transformer("bert", seed=3)
    rebuilt = build_from_spec(spec)
    for name, value in model.state_dict().items():
        assert torch.equal(value, again.state_dict()[name]) and torch.equal(value, rebuilt.state_dict()[name])
    other, _ = tiny_transformer("bert", seed=4)
    assert not torch.equal(model.state_dict()["model.classifier.weight"], other.state_dict()["model.classifier.weight"])


def _per_example_fisher(model, X, y) -> dict[str, torch.Tensor]:
    totals = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for ids, label in zip(X, y, strict=True):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(ids[None]), label[None]).backward()
        for name, p in model.named_parameters():
            totals[name] += p.grad**2
    return {name: value / len(X) for name, value in totals.items()}


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_fisher_by_vmap_equals_a_per_example_loop(topics, arch):
    X, y = torch.tensor(topics[3][:24]), torch.tensor(topics[4][:24])
    model, _ = tiny_transformer(arch)
    model.eval()
    fisher = diagonal_fisher(model, X, y, kind="empirical", batch_size=8, backend="functorch")
    expected = _per_example_fisher(model, X, y)
    for name, value in expected.items():
        torch.testing.assert_close(fisher[name], value, rtol=1e-5, atol=1e-10 * float(value.abs().max()) + 1e-12)


def test_merging_identical_transformers_returns_that_model(topics):
    model, _ = tiny_transformer("bert")
    state = model.state_dict()
    model.eval()
    fisher = diagonal_fisher(model, topics[3][:16].copy(), topics[4][:16].copy(), kind="empirical", backend="functorch")
    inputs = {
        "average": {},
        "task_arithmetic": {"base": tiny_transformer("bert", seed=9)[0].state_dict(), "scaling": 1 / 3},
        "fisher": {"fishers": [fisher] * 3},
    }
    for method, extra in inputs.items():
        merged = merge(method, [state, state, state], **extra)
        for name, value in state.items():
            torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-6)


def test_a_saved_model_reloads_with_from_pretrained_and_predicts_the_same(topics, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    ds, _, tokenizer, X, y = topics
    model, spec = tiny_transformer("bert")
    train(model, X, y, task="classification", epochs=1, lr=1e-3, optimizer="adam", seed=0)
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    save_pretrained(spec, model.state_dict(), tmp_path / "export", tmp_path / "tok")
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    model.eval()
    texts = ds["text"][:4]
    encoded = AutoTokenizer.from_pretrained(tmp_path / "export")(
        texts, padding=True, truncation=True, max_length=20, return_tensors="pt"
    )
    ours = model(torch.as_tensor(X[:4]))
    theirs = reloaded(**encoded).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_length_bucketed_batches_cover_every_row_once_and_group_similar_lengths():
    lengths = torch.randint(1, 60, (1000,), generator=torch.Generator().manual_seed(0))
    batches = list(minibatches(1000, 10, torch.Generator().manual_seed(1), lengths))
    again = list(minibatches(1000, 10, torch.Generator().manual_seed(1), lengths))
    assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))
    assert sorted(torch.cat(batches).tolist()) == list(range(1000))
    padded = sum(int(lengths[b].max()) * len(b) for b in batches)
    plain = sum(int(lengths[b].max()) * len(b) for b in minibatches(1000, 10, torch.Generator().manual_seed(1)))
    assert padded < 0.7 * plain


def test_lora_trains_a_rank_r_update_of_the_targets_and_the_head_only(topics):
    from mergeflow.models.lora import lora

    X, y = topics[3], topics[4]
    model, _ = tiny_transformer("bert")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with lora(model, {"r": 2, "alpha": 4.0, "dropout": 0.0, "target_modules": ["query", "value"]}, seed=0):
        train(model, X, y, task="classification", epochs=2, lr=0.01, optimizer="adam", seed=0)
    after = model.state_dict()
    assert list(after) == list(before)
    for name, value in before.items():
        moved = not torch.equal(after[name], value)
        targeted = name.endswith(("query.weight", "value.weight"))
        assert moved == (targeted or ".classifier." in name), name
        if targeted:
            assert torch.linalg.matrix_rank(after[name] - value, atol=1e-6) <= 2


def test_a_pretrained_directory_loads_its_weights_with_a_new_seeded_head(topics, tmp_path):
    from mergeflow.data.tokenize import load_tokenizer

    model, spec = tiny_transformer("bert", num_labels=4)
    tokenizer = topics[2]
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    save_pretrained(spec, model.state_dict(), tmp_path / "pretrained", tmp_path / "tok")
    options = {"config": {}, "vocab_size": 0, "max_length": 0, "sep_token_id": None, "dropout": 0.0}
    loaded, loaded_spec = build_base(pretrained=str(tmp_path / "pretrained"), num_labels=7, pad_token_id=0, seed=1,
                                     **options)  # fmt: skip
    again, _ = build_base(pretrained=str(tmp_path / "pretrained"), num_labels=7, pad_token_id=0, seed=1, **options)
    state, original = loaded.state_dict(), model.state_dict()
    body = [k for k in original if ".classifier." not in k]
    assert all(torch.equal(state[k], original[k]) for k in body)
    assert state["model.classifier.weight"].shape == (7, 32) and loaded_spec["output_dim"] == 7
    assert torch.equal(state["model.classifier.weight"], again.state_dict()["model.classifier.weight"])
    assert load_tokenizer(tmp_path / "pretrained").get_vocab() == tokenizer.get_vocab()


def test_a_pretrained_load_is_quiet_about_its_new_head_and_warns_of_a_missing_body_tensor(tmp_path, capfd):
    """transformers' load report lists the new head as missing: by design, so not on the console. A body
    tensor the checkpoint lacks is another matter: one warning names it."""
    from safetensors.torch import load_file, save_file

    model, spec = tiny_transformer("bert", num_labels=4)
    save_pretrained(spec, model.state_dict(), tmp_path / "pretrained", None)
    options = {"config": {}, "vocab_size": 0, "max_length": 0, "sep_token_id": None, "dropout": 0.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_base(pretrained=str(tmp_path / "pretrained"), num_labels=7, pad_token_id=0, seed=1, **options)
    assert "MISSING" not in capfd.readouterr().err
    weights = tmp_path / "pretrained" / "model.safetensors"
    state = load_file(str(weights))
    save_file({k: v for k, v in state.items() if "pooler" not in k}, str(weights), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"2 tensors of the pretrained body are not in the checkpoint .*pooler"):
        build_base(pretrained=str(tmp_path / "pretrained"), num_labels=7, pad_token_id=0, seed=1, **options)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(topics, tmp_path):
    from mergeflow.data.tokenize import check_vocabulary

    model, spec = tiny_transformer("bert")
    save_pretrained(spec, model.state_dict(), tmp_path / "small", None)
    bigger = train_tokenizer(training_texts(topics[0]), vocab_size=400)
    assert len(bigger) > 300
    with pytest.raises(DataError, match="the tokenizer has .* tokens but the model's embeddings hold 300"):
        check_vocabulary(bigger, tmp_path / "small")
    check_vocabulary(topics[2], tmp_path / "small")  # 300 tokens: fits


def test_bert_masking_chooses_15_percent_of_real_tokens_and_masks_80_percent_of_them():
    from mergeflow.models.language_model import SpecialIds, mask_tokens

    ids = torch.randint(5, 300, (400, 50), generator=torch.Generator().manual_seed(0))
    ids[:, 40:] = 0
    ids[:, 0] = 1  # a special token, never masked
    special = SpecialIds(pad=0, mask=4, never_masked=(1, 2, 3, 4))
    inputs, labels = mask_tokens(ids, special, 300, torch.Generator().manual_seed(1))
    chosen = labels != -100
    assert not chosen[:, 40:].any() and not chosen[:, 0].any()
    assert abs(chosen.float().sum() / (400 * 39) - 0.15) < 0.01
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(inputs[~chosen], ids[~chosen])
    assert abs((inputs[chosen] == 4).float().mean() - 0.8) < 0.02
    assert abs((inputs[chosen] == ids[chosen]).float().mean() - 0.1) < 0.02


@pytest.mark.parametrize(("arch", "objective"), [("bert", "mlm"), ("gpt2", "clm")])
def test_language_model_pretraining_trains_the_body_reproducibly(topics, arch, objective):
    from mergeflow.models.language_model import SpecialIds, pretrain_language_model

    tokenizer = topics[2]
    special = SpecialIds(tokenizer.pad_token_id, tokenizer.mask_token_id, tuple(tokenizer.all_special_ids))
    ids = torch.tensor(topics[3])
    runs = []
    for _ in range(2):
        model, _ = tiny_transformer(arch)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        losses = pretrain_language_model(model, ids, special, objective=objective, epochs=3, lr=3e-3, seed=0)
        runs.append(model.state_dict())
    assert losses[-1] < losses[0] < 1.2 * np.log(len(tokenizer))
    head = ("model.classifier.", "model.score.")
    for name, value in before.items():
        assert torch.equal(runs[0][name], runs[1][name]), name
        if "pooler" not in name:
            assert torch.equal(runs[0][name], value) == name.startswith(head), name


def _write_pairs(path, rows: int, seed: int):
    """Two sentences a row (premise, hypothesis) of independent topics, labelled with the hypothesis' topic."""
    import csv

    with write_topic_csv(path.with_suffix(".topics.csv"), rows=2 * rows, seed=seed).open() as f:
        records = list(csv.DictReader(f))
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["premise", "hypothesis", "label"])
        for premise, hypothesis in zip(records[:rows], records[rows:], strict=True):
            writer.writerow([premise["sentence"], hypothesis["sentence"], hypothesis["topic"]])
    return path


def test_sentence_pairs_are_two_segments_and_the_second_text_is_read(tmp_path):
    """NLI-style pairs: ``<s> a </s> b </s>``, and a tiny BERT learns a label that only the second text of the
    pair tells (the first is of an independent topic): test accuracy, chance 0.25."""
    path = _write_pairs(tmp_path / "pairs.csv", rows=600, seed=0)
    ds, info = load_text_source(
        "csv", data_files=str(path), text_column="premise", text_pair_column="hypothesis", label_column="label"
    )
    assert info["pair"] and ds.column_names[:2] == ["text", "text_pair"]
    tokenizer = train_tokenizer(training_texts(ds), vocab_size=300)
    X, y = to_arrays(encode_dataset(ds, tokenizer, 56), {"input_shape": [56], "task": "classification"})
    sep = tokenizer.sep_token_id
    assert ((X == sep).sum(1) == 2).all() and (X[:, 0] == tokenizer.cls_token_id).all()
    whole = int(np.flatnonzero(X[:, -1] == tokenizer.pad_token_id)[0])  # a pair that was not cut
    row = ds[whole]
    assert tokenizer.decode(X[whole], skip_special_tokens=True).split() == f"{row['text']} {row['text_pair']}".split()
    model, _ = build_base(pretrained=None, config=TINY["bert"], num_labels=4, vocab_size=300, max_length=56,
                          pad_token_id=tokenizer.pad_token_id, sep_token_id=sep, dropout=0.0, seed=0)  # fmt: skip
    train(model, X[:500], y[:500], task="classification", epochs=20, lr=0.003, optimizer="adam", seed=0)
    model.eval()
    with torch.no_grad():
        accuracy = (model(torch.as_tensor(X[500:])).argmax(1).numpy() == y[500:]).mean()
    assert accuracy > 0.8, accuracy
