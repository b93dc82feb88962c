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


class LogMeanSoftmax:
    """``log(mean_m softmax(logits_m))`` over members added one at a time, holding one member's worth of values.

    A log-mean-exp of log-softmaxes in member order: the running sum is kept relative to the running maximum
    (rescaled when a member raises it), so it stays finite for any logits. The result's "logits" are
    normalised log-probabilities: their softmax is the members' mean probabilities, their argmax the
    ensemble's class.
    """

    def __init__(self) -> None:
        self._top: np.ndarray | None = None
        self._sum: np.ndarray | None = None
        self._count = 0

    def add(self, logits: np.ndarray) -> None:
        """Add one member's logits (rows × classes)."""
        log_probs = _log_softmax(logits)
        if self._top is None or self._sum is None:
            self._top, self._sum = log_probs, np.ones_like(log_probs)
        else:
            top = np.maximum(self._top, log_probs)
            self._sum = self._sum * np.exp(self._top - top) + np.exp(log_probs - top)
            self._top = top
        self._count += 1

    def result(self) -> np.ndarray:
        """The members' combined normalised log-probabilities."""
        if self._top is None or self._sum is None:
            raise ValueError("an ensemble needs at least one member")
        return self._top + np.log(self._sum / self._count)


class MeanOutputs:
    """The mean of members' outputs added one at a time: a running sum in member order (the same bits as
    ``np.mean`` over the stacked members), holding one member's worth of values."""

    def __init__(self) -> None:
        self._sum: np.ndarray | None = None
        self._count = 0

    def add(self, outputs: np.ndarray) -> None:
        """Add one member's outputs."""
        outputs = np.asarray(outputs, dtype=np.float64)
        self._sum = outputs.copy() if self._sum is None else self._sum + outputs
        self._count += 1

    def result(self) -> np.ndarray:
        """The members' mean output, in their shape."""
        if self._sum is None:
            raise ValueError("an ensemble needs at least one member")
        return self._sum / self._count


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
