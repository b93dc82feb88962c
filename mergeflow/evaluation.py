"""Test metrics (accuracy, NLL, ECE, MSE, token NLL and perplexity), output ensembling and model ranking."""

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


def language_model_metrics(outputs: np.ndarray) -> dict:
    """Token NLL (nats per predicted token), perplexity and token count of a causal LM's per-row
    ``(N, 2)`` outputs: summed next-token NLL and number of predicted tokens per row."""
    outputs = np.asarray(outputs, dtype=np.float64).reshape(-1, 2)
    tokens = float(outputs[:, 1].sum())
    nll = float(outputs[:, 0].sum() / tokens) if tokens else float("nan")
    return {"nll": nll, "perplexity": float(math.exp(nll)) if tokens else float("nan"), "tokens": int(tokens)}


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
    here), predictions of shape ``(N,)`` or ``(N, 1)`` for regression, per-row summed NLL and token
    counts for a causal LM (``y`` unused)."""
    if task == "classification":
        return classification_metrics(softmax(outputs), y, n_bins=n_bins)
    if task == "regression":
        return regression_metrics(_regression_column(outputs), y, noise_std=noise_std)
    if task == "causal_lm":
        return language_model_metrics(outputs)
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
    """Name of the model with the highest accuracy (classification), lowest mse (regression) or
    lowest token NLL (causal LM); ties go to the alphabetically first name."""
    if not metrics:
        raise ValueError("best_model needs at least one model")
    if task == "classification":
        return min(metrics, key=lambda name: (-metrics[name]["accuracy"], name))
    if task == "regression":
        return min(metrics, key=lambda name: (metrics[name]["mse"], name))
    if task == "causal_lm":
        return min(metrics, key=lambda name: (metrics[name]["nll"], name))
    raise ValueError(f"unknown task {task!r}")


def in_target_units(metrics: dict, std: float) -> dict:
    """Regression metrics of a model trained on a standardised target ``(y - mean) / std`` in the target's
    own units: MSE times ``std**2``, Gaussian NLL plus ``log(std)`` (the same likelihood, its noise scaled
    by ``std``); nested dicts (per-group metrics) too, anything else unchanged."""
    converted = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            value = in_target_units(value, std)
        elif key.endswith("mse"):
            value = value * std**2
        elif key.endswith("nll"):
            value = value + math.log(std)
        converted[key] = value
    return converted


def unigram_row_nll(train_ids: np.ndarray, test_ids: np.ndarray, pad: int, vocab_size: int) -> np.ndarray:
    """Per test row, the summed NLL of its next-token targets under the training split's unigram
    frequencies (add-one smoothed): the input-blind baseline of a causal LM."""
    train_ids, test_ids = np.asarray(train_ids), np.asarray(test_ids)
    targets = train_ids[:, 1:][train_ids[:, 1:] != pad]
    counts = np.bincount(targets, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    predicted = test_ids[:, 1:] != pad
    return -np.where(predicted, log_p[np.where(predicted, test_ids[:, 1:], 0)], 0.0).sum(1)


def _row_scores(task: str, predicted: np.ndarray, y_test: np.ndarray) -> np.ndarray:
    """Higher-is-better score of each test row: correct (0/1), minus squared error, or minus summed token NLL."""
    if task == "classification":
        return (np.asarray(predicted) == y_test).astype(np.float64)
    if task == "causal_lm":
        return -np.asarray(predicted, dtype=np.float64).reshape(len(y_test), -1)[:, 0]
    return -((y_test - np.asarray(predicted, dtype=np.float64).reshape(len(y_test))) ** 2)


def sanity_check(
    predictions: dict[str, np.ndarray], y_train: np.ndarray, y_test: np.ndarray, *, task: str, hints: str
) -> dict[str, object]:
    """Compare every model with one that ignores its input, and warn when that is all they learned.

    ``predictions`` are each model's test predictions: class ids, regression values in the target's
    units, or a causal LM's per-row ``(summed token NLL, tokens)``. The input-blind model predicts the
    training majority class (or the training mean); for a causal LM it is the training unigram
    distribution, and ``y_test`` holds its per-row summed NLL (:func:`unigram_row_nll`; ``y_train``
    unused). A model is *at baseline* when its per-example gain over it (correct minus
    baseline-correct, baseline squared error minus its own, or baseline NLL minus its own) is not
    above two standard errors, a paired test on the same test rows. The warning (None when the models
    learned something) names the centralized model when it is at baseline, or "every model" when all
    are; ``hints`` lists likely causes.
    """
    y_test = np.asarray(y_test)
    if task == "classification":
        classes, counts = np.unique(y_train, return_counts=True)
        constant = classes[np.argmax(counts)]
        baseline_score = (y_test == constant).astype(np.float64)
        report: dict[str, object] = {"baseline": "majority class", "baseline_accuracy": float(baseline_score.mean())}
        reference = f"always predicting the majority class ({baseline_score.mean():.3f})"
    elif task == "causal_lm":
        baseline_score = -y_test.astype(np.float64)
        tokens = float(np.asarray(next(iter(predictions.values())))[:, 1].sum()) if predictions else float("nan")
        nll = float(y_test.sum() / tokens)
        report = {"baseline": "unigram (training token frequencies)", "baseline_nll": nll}
        report["baseline_perplexity"] = math.exp(nll)
        reference = f"the training unigram distribution (a token NLL of {nll:.4g})"
    else:
        constant = float(np.mean(y_train))
        baseline_score = -((y_test.astype(np.float64) - constant) ** 2)
        report = {"baseline": "constant (training mean)", "baseline_mse": float(-baseline_score.mean())}
        reference = f"always predicting the training mean (a test MSE of {-baseline_score.mean():.4g})"
    gains, scores = {}, {}
    for name, predicted in predictions.items():
        score = _row_scores(task, predicted, y_test)
        gain = score - baseline_score
        scores[name] = float(score.mean())
        gains[name] = (float(gain.mean()), 2 * float(gain.std(ddof=1)) / math.sqrt(len(gain)) if len(gain) > 1 else 0.0)
    at_baseline = {name: mean <= noise for name, (mean, noise) in gains.items()}
    report["models_at_baseline"] = sorted(name for name, flag in at_baseline.items() if flag)
    report["warning"] = None
    who = "every model" if all(at_baseline.values()) else None
    if who is None and at_baseline.get("centralized"):
        who = "the centralized model"
    if who is not None and "centralized" in gains:
        mean, noise = gains["centralized"]
        if task == "classification":
            central = f"{scores['centralized']:.3f} test accuracy"
        elif task == "causal_lm":
            central = f"a token NLL of {-scores['centralized'] * len(y_test) / tokens:.4g}"
        else:
            central = f"a test MSE of {-scores['centralized']:.4g}"
        report["warning"] = (
            f"{who} is within noise of {reference}: the centralized model scores {central}, a gain of "
            f"{mean:.3g} ± {noise:.3g} per test row (two standard errors). Likely causes: {hints}"
        )
    return report
