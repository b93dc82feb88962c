"""Test metrics (accuracy, NLL, ECE, MSE), output ensembling and model ranking."""

from __future__ import annotations

import math

import numpy as np

PROB_FLOOR = 1e-12


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable softmax over the last axis (float64)."""
    return np.exp(_log_softmax(logits))


def classification_metrics(probs: np.ndarray, y: np.ndarray, *, n_bins: int = 15) -> dict:
    """Accuracy, NLL and expected calibration error of class probabilities.

    Args:
        probs: predicted probabilities, shape ``(N, K)``.
        y: true class indices, shape ``(N,)``.
        n_bins: number of equal-width confidence bins on ``[0, 1]`` for ECE.

    Returns:
        ``{"accuracy", "nll", "ece"}`` as python floats, where ``nll`` is the
        mean of ``-log p_y`` (probabilities clipped at 1e-12) and ``ece`` is
        ``sum_b |B_b| / N * |acc_b - conf_b|`` over bins ``(lo, hi]`` of the
        top-class confidence.
    """
    probs = np.asarray(probs, dtype=np.float64)
    y = np.asarray(y).astype(np.int64).reshape(-1)
    pred = probs.argmax(axis=1)
    correct = (pred == y).astype(np.float64)
    p_true = np.clip(probs[np.arange(len(y)), y], PROB_FLOOR, None)
    confidence = probs.max(axis=1)
    bins = np.clip(np.ceil(confidence * n_bins).astype(np.int64) - 1, 0, n_bins - 1)
    ece = 0.0
    for b in np.unique(bins):
        in_bin = bins == b
        ece += in_bin.mean() * abs(correct[in_bin].mean() - confidence[in_bin].mean())
    return {
        "accuracy": float(correct.mean()),
        "nll": float(-np.log(p_true).mean()),
        "ece": float(ece),
    }


def regression_metrics(pred: np.ndarray, y: np.ndarray, *, noise_std: float) -> dict:
    """Mean squared error and mean Gaussian NLL with variance ``noise_std**2``.

    Returns:
        ``{"mse", "nll"}`` as python floats, with
        ``nll = mean(0.5 * log(2 pi s^2) + (y - pred)^2 / (2 s^2))``.
    """
    pred = np.asarray(pred, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    sq_err = (pred - y) ** 2
    var = float(noise_std) ** 2
    nll = 0.5 * math.log(2 * math.pi * var) + sq_err / (2 * var)
    return {"mse": float(sq_err.mean()), "nll": float(nll.mean())}


def _regression_column(outputs: np.ndarray) -> np.ndarray:
    """Predictions of ``(N,)`` or ``(N, 1)`` regression outputs as ``(N,)``."""
    outputs = np.asarray(outputs, dtype=np.float64)
    return outputs[:, 0] if outputs.ndim == 2 else outputs


def evaluate_outputs(
    outputs: np.ndarray,
    y: np.ndarray,
    *,
    task: str,
    n_bins: int = 15,
    noise_std: float = 1.0,
) -> dict:
    """Metrics of raw model outputs: logits for classification (softmaxed
    here), predictions of shape ``(N,)`` or ``(N, 1)`` for regression."""
    if task == "classification":
        return classification_metrics(softmax(outputs), y, n_bins=n_bins)
    if task == "regression":
        return regression_metrics(_regression_column(outputs), y, noise_std=noise_std)
    raise ValueError(f"unknown task {task!r}")


def ensemble_outputs(outputs_list: list[np.ndarray], *, task: str) -> np.ndarray:
    """Combine the raw outputs of several models into one raw output.

    Classification: returns ``log(mean_m softmax(logits_m))``, computed stably
    as a log-mean-exp of log-softmaxes.  These "logits" are normalised
    log-probabilities, so ``softmax`` of them (as in :func:`evaluate_outputs`)
    gives back exactly the mean of the members' probabilities, and their
    argmax is the ensemble's predicted class.

    Regression: returns the mean prediction, with the members' output shape.
    """
    if not outputs_list:
        raise ValueError("ensemble_outputs needs at least one member")
    stacked = np.stack([np.asarray(o, dtype=np.float64) for o in outputs_list])
    if task == "classification":
        log_probs = _log_softmax(stacked)
        top = log_probs.max(axis=0)
        return top + np.log(np.exp(log_probs - top).mean(axis=0))
    if task == "regression":
        return stacked.mean(axis=0)
    raise ValueError(f"unknown task {task!r}")


def best_model(metrics: dict[str, dict], *, task: str) -> str:
    """Name of the model with the highest accuracy (classification) or lowest
    mse (regression); ties go to the alphabetically first name."""
    if not metrics:
        raise ValueError("best_model needs at least one model")
    if task == "classification":
        return min(metrics, key=lambda name: (-metrics[name]["accuracy"], name))
    if task == "regression":
        return min(metrics, key=lambda name: (metrics[name]["mse"], name))
    raise ValueError(f"unknown task {task!r}")


def _input_blind_baseline(y_train: np.ndarray, y_test: np.ndarray, task: str) -> dict[str, float | str]:
    """The test score of a model that ignores its input: the training majority class, or the training mean."""
    if task == "classification":
        classes, counts = np.unique(y_train, return_counts=True)
        majority = classes[np.argmax(counts)]
        accuracy = float(np.mean(y_test == majority))
        noise = 2 * math.sqrt(max(accuracy * (1 - accuracy), 1 / len(y_test)) / len(y_test))
        return {"baseline": "majority class", "baseline_accuracy": accuracy, "noise": noise}
    mse = float(np.mean((np.asarray(y_test, np.float64) - float(np.mean(y_train))) ** 2))
    return {"baseline": "constant (training mean)", "baseline_mse": mse, "noise": 2 * math.sqrt(2 / len(y_test)) * mse}


def sanity_check(
    metrics: dict[str, dict], y_train: np.ndarray, y_test: np.ndarray, *, task: str, hints: str
) -> dict[str, object]:
    """Compare every model with one that ignores its input, and warn when that is all they learned.

    A model is *at baseline* when its test accuracy is within two binomial standard errors of the
    training majority class's (or of chance), or its MSE within two standard errors of the training
    mean's. The warning (None when the models learned something) names the centralized model when
    it is at baseline, or "every model" when all are; ``hints`` lists likely causes.
    """
    report: dict[str, object] = _input_blind_baseline(y_train, y_test, task)
    if task == "classification":
        floor = max(float(report["baseline_accuracy"]), 1 / len(np.unique(y_train)))
        at_baseline = {name: m["accuracy"] <= floor + report["noise"] for name, m in metrics.items()}
        key, unit, reference = "accuracy", "test accuracy", f"always predicting the majority class ({floor:.3f})"
    else:
        ceiling = float(report["baseline_mse"])
        at_baseline = {name: m["mse"] >= ceiling - report["noise"] for name, m in metrics.items()}
        key, unit, reference = "mse", "test MSE", f"always predicting the training mean ({ceiling:.4g})"
    report["models_at_baseline"] = sorted(name for name, flag in at_baseline.items() if flag)
    report["warning"] = None
    central = metrics.get("centralized")
    who = "every model" if all(at_baseline.values()) else None
    if who is None and at_baseline.get("centralized"):
        who = "the centralized model"
    if who is not None and central is not None:
        report["warning"] = (
            f"{who} is within noise of {reference}: the centralized model scores {central[key]:.3f} {unit}. "
            f"Likely causes: {hints}"
        )
    return report
