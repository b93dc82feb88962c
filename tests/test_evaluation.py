from __future__ import annotations

import math
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from mergeflow.errors import MergeflowError
from mergeflow.evaluation import SanityCheck, best_model, ensemble_outputs, evaluate_outputs, sanity_check
from mergeflow.metrics import classification_metrics, regression_metrics, softmax
from mergeflow.objectives import get_objective
from mergeflow.plots import plot_comparison


def test_softmax_is_stable_and_normalised() -> None:
    probs = softmax(np.array([[1000.0, 1000.0, -1000.0], [0.0, math.log(3.0), 0.0]]))
    np.testing.assert_allclose(probs, [[0.5, 0.5, 0.0], [0.2, 0.6, 0.2]], atol=1e-12)


def test_accuracy_and_nll_on_hand_made_probs() -> None:
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5], [0.5, 0.2, 0.3]])
    y = np.array([0, 2, 2, 1])
    m = classification_metrics(probs, y)
    assert m["accuracy"] == 0.5
    assert m["nll"] == pytest.approx(-(math.log(0.7) + math.log(0.3) + math.log(0.5) + math.log(0.2)) / 4)
    assert all(type(v) is float for v in m.values())


def test_nll_clips_zero_probability() -> None:
    m = classification_metrics(np.array([[1.0, 0.0]]), np.array([1]))
    assert m["nll"] == pytest.approx(-math.log(1e-12))


def test_ece_is_zero_when_perfectly_calibrated() -> None:
    # 10 predictions at confidence 0.8 with 8 right, 5 at 0.6 with 3 right.
    probs = np.array([[0.8, 0.2]] * 10 + [[0.6, 0.4]] * 5)
    y = np.array([0] * 8 + [1] * 2 + [0] * 3 + [1] * 2)
    assert classification_metrics(probs, y)["ece"] == pytest.approx(0.0, abs=1e-12)


def test_ece_two_bin_hand_computed() -> None:
    probs = np.array(
        [
            [0.40, 0.30, 0.30],  # bin [0, .5]: right
            [0.45, 0.35, 0.20],  # bin [0, .5]: wrong
            [0.90, 0.05, 0.05],  # bin (.5, 1]: right
            [0.70, 0.20, 0.10],  # bin (.5, 1]: wrong
        ]
    )
    y = np.array([0, 1, 0, 2])
    # bin 0: acc .5, conf .425; bin 1: acc .5, conf .8
    expected = 0.5 * abs(0.5 - 0.425) + 0.5 * abs(0.5 - 0.8)
    assert classification_metrics(probs, y, n_bins=2)["ece"] == pytest.approx(expected)


def test_regression_metrics_match_gaussian_formula() -> None:
    pred, y, sigma = np.array([0.0, 1.0, 2.0]), np.array([0.5, 1.0, 1.0]), 2.0
    m = regression_metrics(pred, y, noise_std=sigma)
    density = np.exp(-((y - pred) ** 2) / (2 * sigma**2)) / np.sqrt(2 * np.pi * sigma**2)
    assert m["mse"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert m["nll"] == pytest.approx(-np.log(density).mean())


def test_evaluate_outputs_dispatches_on_task() -> None:
    logits = np.array([[2.0, 0.0], [0.0, 1.0], [3.0, -1.0]])
    y = np.array([0, 0, 0])
    assert evaluate_outputs(logits, y, task="classification", n_bins=5) == classification_metrics(
        softmax(logits), y, n_bins=5
    )
    reg = evaluate_outputs(np.array([[1.0], [3.0]]), np.array([1.0, 1.0]), task="regression", noise_std=0.5)
    assert reg == regression_metrics(np.array([1.0, 3.0]), np.array([1.0, 1.0]), noise_std=0.5)
    with pytest.raises(MergeflowError, match="objective 'ranking' is unknown"):
        evaluate_outputs(logits, y, task="ranking")


def test_ensemble_of_identical_members_equals_member() -> None:
    logits = np.random.default_rng(0).normal(size=(6, 4)) * 5
    ens = ensemble_outputs([logits, logits, logits], task="classification")
    np.testing.assert_allclose(softmax(ens), softmax(logits), atol=1e-12)
    assert evaluate_outputs(ens, np.zeros(6), task="classification") == pytest.approx(
        evaluate_outputs(logits, np.zeros(6), task="classification")
    )
    preds = np.arange(5.0).reshape(5, 1)
    np.testing.assert_array_equal(ensemble_outputs([preds, preds], task="regression"), preds)


def test_ensemble_averages_probabilities_and_predictions() -> None:
    rng = np.random.default_rng(1)
    members = [rng.normal(size=(5, 3)) * 3 for _ in range(3)]
    ens = ensemble_outputs(members, task="classification")
    mean_probs = np.mean([softmax(m) for m in members], axis=0)
    np.testing.assert_allclose(np.exp(ens), mean_probs, atol=1e-12)
    np.testing.assert_allclose(softmax(ens), mean_probs, atol=1e-12)
    # Extreme logits stay finite.
    big = ensemble_outputs([np.array([[1e4, 0.0]]), np.array([[0.0, 1e4]])], task="classification")
    np.testing.assert_allclose(np.exp(big), [[0.5, 0.5]])
    reg = ensemble_outputs([np.array([1.0, 2.0]), np.array([3.0, 6.0])], task="regression")
    np.testing.assert_array_equal(reg, [2.0, 4.0])


def test_best_model_by_task_with_name_tie_break() -> None:
    cls = {
        "merged": {"accuracy": 0.9},
        "client_1": {"accuracy": 0.95},
        "b_ens": {"accuracy": 0.95},
        "a_low": {"accuracy": 0.5},
    }
    assert best_model(cls, task="classification") == "b_ens"
    reg = {"zeta": {"mse": 0.1}, "alpha": {"mse": 0.2}, "beta": {"mse": 0.1}}
    assert best_model(reg, task="regression") == "beta"


@pytest.mark.parametrize("task,key", [("classification", "accuracy"), ("regression", "mse")])
def test_plot_comparison_writes_png(tmp_path: Path, task: str, key: str) -> None:
    metrics = {f"model_{i:02d}_with_a_long_name": {key: 0.5 + i / 40, "nll": 1.0 - i / 30} for i in range(15)}
    path = tmp_path / "plots" / "comparison.png"
    plot_comparison(metrics, path, task=task)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    assert [p.name for p in path.parent.iterdir()] == ["comparison.png"]  # no temp left over


def _stacked_log_mean_softmax(members: list[np.ndarray]) -> np.ndarray:
    """The ensemble as it was computed before it streamed: all members stacked, shifted by their maximum."""
    log_probs = np.stack([np.log(softmax(m)) for m in members])
    top = log_probs.max(axis=0)
    return top + np.log(np.exp(log_probs - top).mean(axis=0))


def test_the_output_ensemble_adds_members_one_at_a_time_in_bounded_memory():
    """A thousand clients' outputs kept for the ensemble were the evaluate step's peak (2.2 GB at 20,000 rows)."""
    rng = np.random.default_rng(0)
    members = [(3 * rng.standard_normal((2000, 5))).astype(np.float32) for _ in range(50)]
    classification, regression = get_objective("classification"), get_objective("regression")
    combined = classification.ensemble_accumulator()
    for member in members:
        combined.add(member)
    streamed = combined.result()
    assert np.array_equal(streamed, ensemble_outputs(members, task="classification"))  # the list API's bits
    np.testing.assert_allclose(streamed, _stacked_log_mean_softmax(members), rtol=1e-14, atol=0)
    means = regression.ensemble_accumulator()
    for member in members:
        means.add(member[:, :1])
    assert np.array_equal(means.result(), np.stack([m[:, :1].astype(np.float64) for m in members]).mean(axis=0))

    def peak(objective, count: int) -> int:
        tracemalloc.start()
        accumulator = objective.ensemble_accumulator()
        for member in members[:count]:
            accumulator.add(member)
        accumulator.result()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    member_bytes = members[0].size * 8
    for objective in (classification, regression):
        assert peak(objective, 50) < peak(objective, 5) + member_bytes  # not 45 more members' worth


def test_the_sanity_check_keeps_a_few_numbers_per_model_not_its_predictions():
    rng = np.random.default_rng(1)
    y_test, y_train = rng.integers(0, 3, 20_000), rng.integers(0, 3, 100)
    models = {f"client_{i:03d}": np.where(rng.random(20_000) < 0.5, y_test, 0) for i in range(50)}
    models["centralized"] = y_test.copy()
    whole = sanity_check(models, y_train, y_test, task="classification", hints="h.")
    assert whole["warning"] is None and whole["models_at_baseline"] == []

    def peak(count: int) -> int:
        tracemalloc.start()
        check = SanityCheck(y_train, y_test, task="classification", hints="h.")
        for name in list(models)[:count]:
            check.add(name, models[name])
        check.report()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    assert peak(50) < peak(5) + y_test.size * 8  # not 45 more models' row scores
