"""Causal language modelling: next-token cross-entropy; token NLL and perplexity; unigram baseline.

A text is one example. Its targets are its own tokens shifted by one (the data's labels only mark
rows, for partitions and groups), and what prediction keeps of it is its summed next-token NLL and
its number of predicted tokens: ``(N, 2)``, never ``N × L × V`` logits.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Generator, Tensor, nn

from mergeflow.metrics import language_model_metrics, unigram_row_nll
from mergeflow.models.token_model import TokenModel
from mergeflow.objectives.base import Baseline, Objective

IGNORE_INDEX = -100  # positions a token loss skips (padding, and the last position of a text)
_ROWS = 64  # rows per forward when scoring: the logits are rows × length × vocabulary


def next_token_labels(ids: torch.Tensor, pad: int) -> torch.Tensor:
    """Causal-LM targets of right-padded ids: each position predicts the next token; padding and the
    last position are :data:`IGNORE_INDEX`."""
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = torch.where(ids[:, 1:] != pad, ids[:, 1:], IGNORE_INDEX)
    return labels


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``(N, L', V)`` token logits against ``(N, L)`` labels, over the positions that are
    not :data:`IGNORE_INDEX`; labels are cut to the ``L'`` columns the model kept (it drops columns that
    are padding in every row, whose labels are all ignored)."""
    labels = labels[:, : logits.shape[1]]
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction=reduction
    )


class TokenNLL(nn.Module):
    """Summed next-token cross-entropy of ``(N, L, V)`` logits, ignoring :data:`IGNORE_INDEX`."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_cross_entropy(logits, labels, reduction="sum")


def _padding(model: nn.Module) -> int:
    if not isinstance(model, TokenModel):
        raise TypeError(f"a causal LM objective needs a TokenModel over token ids, got {type(model).__name__}")
    return model.pad_token_id


class CausalLM(Objective):
    """Next-token prediction of a :class:`~mergeflow.models.token_model.TokenModel`."""

    def targets(self, y, inputs: torch.Tensor, model: nn.Module) -> torch.Tensor:
        return next_token_labels(inputs, _padding(model))

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_cross_entropy(outputs, targets)

    def outputs(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """Per row, the summed next-token NLL and the number of predicted tokens: ``(N, 2)``."""
        pad = _padding(model)
        rows = []
        for chunk in inputs.long().split(_ROWS):
            labels = next_token_labels(chunk, pad)
            logits = model(chunk)
            losses = token_cross_entropy(logits, labels, reduction="none").reshape(len(chunk), -1)
            counts = (labels[:, : logits.shape[1]] >= 0).sum(1).to(losses.dtype)
            rows.append(torch.stack([losses.sum(1), counts], dim=1))
        return torch.cat(rows)

    def outputs_loss(self, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean next-token NLL over every predicted token of the rows."""
        return outputs[:, 0].sum() / outputs[:, 1].sum()

    def metrics(self, outputs: np.ndarray, y: np.ndarray | None, *, n_bins: int, noise_std: float) -> dict:
        return language_model_metrics(outputs)

    def baseline_targets(self, train, test, info):
        """Each test row's summed NLL under the training split's unigram frequencies (``y_train`` unused)."""
        tokens = info["tokenizer"]
        return train[1], unigram_row_nll(train[0], test[0], tokens["pad_token_id"], tokens["vocab_size"])

    def baseline(self, y_train: np.ndarray, y_test: np.ndarray, predictions: dict[str, np.ndarray]) -> Baseline:
        tokens = float(np.asarray(next(iter(predictions.values())))[:, 1].sum()) if predictions else float("nan")
        nll = float(y_test.sum() / tokens)
        rows = len(y_test)
        return Baseline(
            -y_test.astype(np.float64),
            {
                "baseline": "unigram (training token frequencies)",
                "baseline_nll": nll,
                "baseline_perplexity": math.exp(nll),
            },
            f"the training unigram distribution (a token NLL of {nll:.4g})",
            lambda score: f"a token NLL of {-score * rows / tokens:.4g}",
        )

    def row_scores(self, predicted: np.ndarray, y_test: np.ndarray) -> np.ndarray:
        return -np.asarray(predicted, dtype=np.float64).reshape(len(y_test), -1)[:, 0]

    def summed_loss(self) -> nn.Module:
        return TokenNLL()

    def fisher_targets(
        self, model: nn.Module, X: Tensor, y: Tensor, kind: str, noise_std: float, rng: Generator
    ) -> Tensor:
        """The data's next tokens, or (sampled) one token drawn from the model at every position the data predicts."""
        labels = next_token_labels(X, _padding(model))
        if kind != "sampled":
            return labels
        with torch.no_grad():
            probs = torch.softmax(model(X), dim=-1)
        rows = probs.reshape(-1, probs.shape[-1]).to(rng.device)  # drawn where the generator is, then moved
        drawn = torch.multinomial(rows, 1, generator=rng).reshape(labels.shape).to(labels.device)
        return torch.where(labels != IGNORE_INDEX, drawn, IGNORE_INDEX)
