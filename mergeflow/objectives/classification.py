"""Classification: cross-entropy on logits; accuracy, NLL and ECE; the majority class as baseline."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Generator, Tensor, nn

from mergeflow.metrics import LogMeanSoftmax, classification_metrics, softmax
from mergeflow.objectives.base import Baseline, FisherTarget, Objective


class Classification(Objective):
    """Class ids as targets, ``(N, C)`` logits as outputs."""

    def targets(self, y, inputs: torch.Tensor, model: nn.Module) -> torch.Tensor:
        return torch.as_tensor(y, device=inputs.device).to(torch.long).reshape(-1)

    def output_dim(self, info: dict[str, Any]) -> int:
        return int(info["num_classes"])

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, targets)

    def metrics(self, outputs: np.ndarray, y: np.ndarray | None, *, n_bins: int, noise_std: float) -> dict:
        return classification_metrics(softmax(outputs), y, n_bins=n_bins)

    def ensemble_accumulator(self) -> LogMeanSoftmax:
        """``log(mean_m softmax(logits_m))``: normalised log-probabilities whose softmax is the members' mean."""
        return LogMeanSoftmax()

    def predictions(self, outputs: np.ndarray, scale: dict[str, float]) -> np.ndarray:
        return outputs.argmax(axis=1)

    def served_columns(self, outputs: np.ndarray, info: dict[str, Any]) -> dict[str, Any]:
        """``label`` (the class as the data had it: a number for numeric labels, else its name), ``score`` and
        one ``probability_<class name>`` column each."""
        count = outputs.shape[1]
        names = info.get("class_names") or [str(c) for c in range(count)]
        labels = info.get("class_values") or info.get("class_names") or list(range(count))
        probabilities = softmax(outputs)
        columns = {"label": [labels[i] for i in probabilities.argmax(axis=1)], "score": probabilities.max(axis=1)}
        return columns | {f"probability_{name}": probabilities[:, i] for i, name in enumerate(names)}

    def baseline(self, y_train: np.ndarray, y_test: np.ndarray, predictions: dict[str, np.ndarray]) -> Baseline:
        classes, counts = np.unique(y_train, return_counts=True)
        scores = (y_test == classes[np.argmax(counts)]).astype(np.float64)
        accuracy = float(scores.mean())
        return Baseline(
            scores,
            {"baseline": "majority class", "baseline_accuracy": accuracy},
            f"always predicting the majority class ({accuracy:.3f})",
            lambda score: f"{score:.3f} test accuracy",
        )

    def row_scores(self, predicted: np.ndarray, y_test: np.ndarray) -> np.ndarray:
        return (np.asarray(predicted) == y_test).astype(np.float64)

    def versus(self, result: dict, reference: dict) -> dict:
        return {"accuracy_gain": result["accuracy"] - reference["accuracy"]}

    def summed_loss(self) -> nn.Module:
        return nn.CrossEntropyLoss(reduction="sum")

    def fisher_targets(
        self, model: nn.Module, X: Tensor, y: Tensor, kind: str, noise_std: float, rng: Generator
    ) -> Tensor:
        if kind != "sampled":
            return y
        with torch.no_grad():
            probs = torch.softmax(model(X), dim=1)
        # drawn where the generator is (the CPU: the same labels on every device), then moved
        return torch.multinomial(probs.to(rng.device), 1, generator=rng)[:, 0].to(probs.device)

    def exact_targets(self, model: nn.Module, X: torch.Tensor, noise_std: float) -> list[FisherTarget]:
        with torch.no_grad():
            probs = torch.softmax(model(X), dim=1)
        return [
            (torch.full((len(X),), c, dtype=torch.long, device=X.device), probs[:, c]) for c in range(probs.shape[1])
        ]
