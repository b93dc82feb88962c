"""Test metrics of a model's outputs, output ensembles, model ranking and the sanity check, for any
objective: each asks the objective (:mod:`mergeflow.objectives`) what its outputs mean."""

from __future__ import annotations

import math

import numpy as np

from mergeflow.metric_direction import lower_is_better
from mergeflow.objectives import Baseline, Objective, get_objective


def evaluate_outputs(
    outputs: np.ndarray, y: np.ndarray | None, *, task: str | Objective, n_bins: int = 15, noise_std: float = 1.0
) -> dict:
    """Metrics of raw model outputs: logits for classification (softmaxed here), predictions of shape
    ``(N,)`` or ``(N, 1)`` for regression, per-row summed NLL and token counts for a causal LM (``y``
    unused)."""
    return get_objective(task).metrics(outputs, y, n_bins=n_bins, noise_std=noise_std)


def ensemble_outputs(outputs_list: list[np.ndarray], *, task: str | Objective) -> np.ndarray:
    """Combine the raw outputs of several models into one raw output: for classification the log of the
    mean probabilities (normalised log-probabilities), for regression the mean prediction."""
    if not outputs_list:
        raise ValueError("ensemble_outputs needs at least one member")
    return get_objective(task).ensemble(outputs_list)


def best_model(metrics: dict[str, dict], *, task: str | Objective) -> str:
    """Name of the model best by the objective's ranking metric (highest accuracy, lowest MSE, lowest
    token NLL); ties go to the alphabetically first name."""
    if not metrics:
        raise ValueError("best_model needs at least one model")
    rank_by = get_objective(task).declaration.rank_by
    sign = 1.0 if lower_is_better(rank_by) else -1.0
    return min(metrics, key=lambda name: (sign * metrics[name][rank_by], name))


def sanity_check(
    predictions: dict[str, np.ndarray], y_train: np.ndarray, y_test: np.ndarray, *, task: str | Objective, hints: str
) -> dict[str, object]:
    """Compare every model with one that ignores its input, and warn when that is all they learned.

    ``predictions`` are each model's test predictions as the objective's ``predictions`` gives them:
    class ids, regression values in the target's units, or a causal LM's per-row ``(summed token NLL,
    tokens)``. The input-blind model is the objective's ``baseline``: the training majority class, the
    training mean, or for a causal LM the training unigram distribution (``y_test`` then holds its
    per-row summed NLL, :func:`mergeflow.metrics.unigram_row_nll`; ``y_train`` unused). A model is *at
    baseline* when its per-example gain over it is not above two standard errors, a paired test on the
    same test rows. The warning (None when the models learned something) names the centralized model
    when it is at baseline, or "every model" when all are; ``hints`` lists likely causes.
    """
    check = SanityCheck(y_train, y_test, task=task, hints=hints)
    for name, predicted in predictions.items():
        check.add(name, predicted)
    return check.report()


class SanityCheck:
    """:func:`sanity_check` with the models added one at a time, keeping a few numbers per model (its mean
    score, and its mean gain over the baseline with two standard errors), not its predictions.

    The baseline is built when the first model is added (a causal LM's counts the first model's tokens).
    """

    def __init__(self, y_train: np.ndarray, y_test: np.ndarray, *, task: str | Objective, hints: str) -> None:
        self._objective = get_objective(task)
        self._y_train, self._y_test, self._hints = y_train, np.asarray(y_test), hints
        self._baseline: Baseline | None = None
        self._scores: dict[str, float] = {}
        self._gains: dict[str, tuple[float, float]] = {}

    def add(self, name: str, predicted: np.ndarray) -> None:
        """Score model ``name``'s test predictions against the baseline."""
        baseline = self._baseline_of({name: predicted})
        score = self._objective.row_scores(predicted, self._y_test)
        gain = score - baseline.scores
        self._scores[name] = float(score.mean())
        noise = 2 * float(gain.std(ddof=1)) / math.sqrt(len(gain)) if len(gain) > 1 else 0.0
        self._gains[name] = (float(gain.mean()), noise)

    def report(self) -> dict[str, object]:
        """The baseline, the models at baseline and the warning, over the models added so far."""
        baseline = self._baseline_of({})
        report: dict[str, object] = dict(baseline.report)
        at_baseline = {name: mean <= noise for name, (mean, noise) in self._gains.items()}
        report["models_at_baseline"] = sorted(name for name, flag in at_baseline.items() if flag)
        report["warning"] = None
        who = "every model" if all(at_baseline.values()) else None
        if who is None and at_baseline.get("centralized"):
            who = "the centralized model"
        if who is not None and "centralized" in self._gains:
            mean, noise = self._gains["centralized"]
            report["warning"] = (
                f"{who} is within noise of {baseline.reference}: the centralized model scores "
                f"{baseline.describe(self._scores['centralized'])}, a gain of {mean:.3g} ± {noise:.3g} per test row "
                f"(two standard errors). Likely causes: {self._hints}"
            )
        return report

    def _baseline_of(self, first: dict[str, np.ndarray]) -> Baseline:
        """The baseline, built on the first call (``first``: the first model's predictions, or none)."""
        if self._baseline is None:
            self._baseline = self._objective.baseline(self._y_train, self._y_test, first)
        return self._baseline
