"""Causal language models (``model.transformers.task: causal_lm``) on their own: tied weights, training, Fishers,
RegMean on GPT-2's Conv1D layers, token metrics and the unigram baseline; offline, on data the tests write."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from text_fixtures import tiny_transformer, tokenized_topics

from mergeflow.evaluation import evaluate_outputs, sanity_check
from mergeflow.fisher import diagonal_fisher, fisher_factors
from mergeflow.grams import CONV1D, linear_input_grams
from mergeflow.merge import merge
from mergeflow.metrics import unigram_row_nll
from mergeflow.models import build_from_spec
from mergeflow.models.hf import CausalLM, save_pretrained
from mergeflow.objectives.causal_lm import next_token_labels
from mergeflow.training import predict, train


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """The topic CSV as token ids (right-padded to 20) and its tokenizer."""
    ds, _, tokenizer, X, y = tokenized_topics(tmp_path_factory.mktemp("clm"))
    return ds, tokenizer, torch.tensor(X), torch.tensor(y)


def _lm(seed: int = 0) -> tuple[CausalLM, dict]:
    return tiny_transformer("gpt2", seed=seed, num_labels=1, task="causal_lm")


def test_a_tied_lm_head_is_one_tensor_in_the_state_and_reloads_tied(texts, tmp_path):
    from transformers import AutoModelForCausalLM

    model, spec = _lm()
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
    state = model.state_dict()
    assert "model.transformer.wte.weight" in state and "model.lm_head.weight" not in state
    rebuilt = build_from_spec(spec)
    rebuilt.load_state_dict({k: v + 1 for k, v in state.items()})  # strict: the tied key is filled from wte
    assert rebuilt.model.lm_head.weight is rebuilt.model.transformer.wte.weight
    torch.testing.assert_close(rebuilt.model.lm_head.weight, state["model.transformer.wte.weight"] + 1)
    save_pretrained(spec, state, tmp_path / "export", None)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    ids = texts[2][:4]
    ours = model.eval()(ids)  # trimmed to the batch's longest text
    ids = ids[:, : ours.shape[1]]
    real = ids != 0  # right padding: every real token sees only real tokens before it
    torch.testing.assert_close(reloaded(input_ids=ids).logits[real], ours[real], atol=1e-5, rtol=1e-5)


def test_training_a_causal_lm_lowers_its_token_nll_below_the_unigram_baseline(texts):
    X = texts[2]
    train_ids, test_ids = X[:150], X[150:]
    model, _ = _lm()
    before = evaluate_outputs(predict(model, test_ids, task="causal_lm"), None, task="causal_lm")
    train(model, train_ids, torch.zeros(150), task="causal_lm", epochs=8, lr=3e-3, optimizer="adam", seed=0)
    after = evaluate_outputs(predict(model, test_ids, task="causal_lm"), None, task="causal_lm")
    tokens = int((next_token_labels(test_ids, 0) >= 0).sum())
    assert before["tokens"] == after["tokens"] == tokens
    assert after["perplexity"] == pytest.approx(math.exp(after["nll"]))
    unigram = unigram_row_nll(train_ids.numpy(), test_ids.numpy(), pad=0, vocab_size=300)
    assert after["nll"] < unigram.sum() / tokens < before["nll"]
    report = sanity_check(
        {"centralized": predict(model, test_ids, task="causal_lm")}, None, unigram, task="causal_lm", hints=""
    )
    assert report["warning"] is None and report["models_at_baseline"] == []
    untrained = _lm(seed=1)[0]
    blind = sanity_check(
        {"centralized": predict(untrained, test_ids, task="causal_lm")}, None, unigram, task="causal_lm", hints="h"
    )
    assert "the training unigram distribution" in blind["warning"]


def test_unigram_row_nll_is_the_smoothed_frequency_log_loss_of_each_rows_next_tokens():
    train_ids = np.array([[5, 1, 1, 2, 0], [5, 2, 0, 0, 0]])  # targets: 1, 1, 2, 2
    test_ids = np.array([[5, 1, 3, 0, 0]])  # targets 1 and 3
    p = np.array([1, 3, 3, 1]) / 8  # add-one over a vocabulary of 4 (ids 0..3; 5 is out of range of no target)
    expected = -(np.log(p[1]) + np.log(p[3]))
    assert unigram_row_nll(train_ids, test_ids, pad=0, vocab_size=4)[0] == pytest.approx(expected)


def test_causal_lm_fisher_by_vmap_equals_a_per_example_loop_with_the_tied_head(texts):
    X = texts[2][:12]
    model, _ = _lm()
    model.eval()
    fisher = diagonal_fisher(model, X, torch.zeros(12), kind="empirical", task="causal_lm", batch_size=5)
    totals = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for ids in X:
        model.zero_grad()
        logits = model(ids[None])
        labels = next_token_labels(ids[None], 0)[:, : logits.shape[1]]
        torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum").backward()
        for name, p in model.named_parameters():
            totals[name] += p.grad**2
    assert "model.lm_head.weight" not in fisher  # one tensor for the tied embedding and head, both gradients in it
    for name, value in totals.items():
        expected = value / len(X)
        torch.testing.assert_close(fisher[name], expected, rtol=1e-5, atol=1e-10 * float(expected.abs().max()) + 1e-12)
    factors = fisher_factors(model, X, torch.zeros(12), kind="sampled", task="causal_lm", batch_size=5, seed=3)
    assert factors.shape == (12, sum(p.numel() for p in model.parameters()))
    with pytest.raises(ValueError, match="a causal_lm objective has no exact Fisher"):
        diagonal_fisher(model, X, torch.zeros(12), kind="exact", task="causal_lm")


def test_regmean_solves_gpt2_conv1d_layers_in_their_own_orientation(texts):
    X = texts[2]
    states, grams = [], []
    for client, rows in enumerate((slice(0, 60), slice(60, 120))):
        model, _ = _lm(seed=client)
        train(model, X[rows], torch.zeros(60), task="causal_lm", epochs=1, lr=3e-3, optimizer="adam", seed=client)
        states.append(model.state_dict())
        grams.append(linear_input_grams(model, X[rows]))
    conv = [key for key in grams[0] if key.startswith(CONV1D)]
    assert len(conv) == 8 and not any("lm_head" in key for key in grams[0])  # 4 Conv1D per block; tied head left out
    merged = merge("regmean", states, grams=grams, alpha=1.0)
    square = CONV1D + "model.transformer.h.0.attn.c_proj.weight"  # (32, 32): only the orientation tells it apart
    name = square.removeprefix(CONV1D)
    # RegMean's normal equations for y = x W: Σ_k G_k (W* − W_k) = 0.
    residual = sum(g[square] @ (merged[name].double() - s[name].double()) for g, s in zip(grams, states, strict=True))
    scale = sum(float((g[square] @ s[name].double()).abs().max()) for g, s in zip(grams, states, strict=True))
    assert float(residual.abs().max()) < 1e-6 * scale
    wrong = sum(g[square] @ (merged[name].double().T - s[name].double().T) for g, s in zip(grams, states, strict=True))
    assert float(wrong.abs().max()) > 1e-3 * scale
