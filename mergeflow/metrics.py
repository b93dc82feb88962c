"""Metrics of predictions, numpy only: accuracy, NLL and ECE of class probabilities, MSE and Gaussian NLL,
a causal LM's token NLL and perplexity, and the unigram baseline of a language model.

Which of them a model gets is its objective's choice (:mod:`mergeflow.objectives`).
"""

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


def log_mean_softmax(logits_list: list[np.ndarray], chunk_values: int = 1 << 23) -> np.ndarray:
    """``log(mean_m softmax(logits_m))``, computed stably as a log-mean-exp of log-softmaxes.

    These "logits" are normalised log-probabilities: their softmax gives back exactly the mean of the
    members' probabilities, and their argmax is the ensemble's predicted class. Rows are combined
    ``chunk_values`` values (members × rows × classes) at a time: each row's result is its own, so the
    same bits as all at once, and the float64 copies stay at 64 MB whatever the number of members.
    """
    rows = len(logits_list[0])
    step = max(1, chunk_values // max(1, len(logits_list) * int(np.prod(np.shape(logits_list[0])[1:]))))
    starts = range(0, max(rows, 1), step)  # one chunk, empty, for no rows
    parts = [_log_mean_softmax([o[start : start + step] for o in logits_list]) for start in starts]
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def _log_mean_softmax(logits_list: list[np.ndarray]) -> np.ndarray:
    log_probs = _log_softmax(np.stack([np.asarray(o, dtype=np.float64) for o in logits_list]))
    top = log_probs.max(axis=0)
    return top + np.log(np.exp(log_probs - top).mean(axis=0))


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


def unigram_row_nll(train_ids: np.ndarray, test_ids: np.ndarray, pad: int, vocab_size: int) -> np.ndarray:
    """Per test row, the summed NLL of its next-token targets under the training split's unigram
    frequencies (add-one smoothed): the input-blind baseline of a causal LM."""
    train_ids, test_ids = np.asarray(train_ids), np.asarray(test_ids)
    targets = train_ids[:, 1:][train_ids[:, 1:] != pad]
    counts = np.bincount(targets, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    predicted = test_ids[:, 1:] != pad
    return -np.where(predicted, log_p[np.where(predicted, test_ids[:, 1:], 0)], 0.0).sum(1)
