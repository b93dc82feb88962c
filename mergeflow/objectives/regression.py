"""Regression: a Gaussian likelihood with noise ``noise_std``; MSE and NLL; the training mean as baseline."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Generator, Tensor, nn

from mergeflow.device import host_tensor
from mergeflow.metrics import MeanOutputs, regression_metrics
from mergeflow.objectives.base import Baseline, FisherTarget, Objective


def _column(outputs: np.ndarray) -> np.ndarray:
    """Predictions of ``(N,)`` or ``(N, 1)`` outputs as ``(N,)``."""
    outputs = np.asarray(outputs, dtype=np.float64)
    return outputs[:, 0] if outputs.ndim == 2 else outputs


class Regression(Objective):
    """Float targets, ``(N, 1)`` predictions; training minimises ``0.5 · mean((out[:, 0] − y)²)``."""

    def targets(self, y, inputs: torch.Tensor, model: nn.Module) -> torch.Tensor:
        return torch.as_tensor(y, device=inputs.device).to(torch.float32).reshape(-1)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return 0.5 * torch.mean((outputs[:, 0] - targets) ** 2)

    def metrics(self, outputs: np.ndarray, y: np.ndarray | None, *, n_bins: int, noise_std: float) -> dict:
        return regression_metrics(_column(outputs), y, noise_std=noise_std)

    def in_target_units(self, metrics: dict, std: float) -> dict:
        """MSE times ``std**2``, Gaussian NLL plus ``log(std)`` (the same likelihood, its noise scaled by
        ``std``); nested dicts (per-group metrics) too, anything else unchanged."""
        converted = {}
        for key, value in metrics.items():
            if isinstance(value, dict):
                value = self.in_target_units(value, std)
            elif key.endswith("mse"):
                value = value * std**2
            elif key.endswith("nll"):
                value = value + math.log(std)
            converted[key] = value
        return converted

    def ensemble_accumulator(self) -> MeanOutputs:
        """The members' mean prediction, in their output shape."""
        return MeanOutputs()

    def predictions(self, outputs: np.ndarray, scale: dict[str, float]) -> np.ndarray:
        return _column(outputs.reshape(len(outputs), -1)) * scale["std"] + scale["mean"]

    def served_columns(self, outputs: np.ndarray, info: dict[str, Any]) -> dict[str, Any]:
        """``prediction``, in the target's own units."""
        from mergeflow.data.encode import target_scale

        return {"prediction": self.predictions(outputs, target_scale(info))}

    def baseline_targets(self, train, test, info):
        from mergeflow.data.encode import target_scale

        scale = target_scale(info)  # the baseline in the target's own units, as the metrics are
        return train[1] * scale["std"] + scale["mean"], test[1] * scale["std"] + scale["mean"]

    def baseline(self, y_train: np.ndarray, y_test: np.ndarray, predictions: dict[str, np.ndarray]) -> Baseline:
        scores = -((y_test.astype(np.float64) - float(np.mean(y_train))) ** 2)
        mse = float(-scores.mean())
        return Baseline(
            scores,
            {"baseline": "constant (training mean)", "baseline_mse": mse},
            f"always predicting the training mean (a test MSE of {mse:.4g})",
            lambda score: f"a test MSE of {-score:.4g}",
        )

    def row_scores(self, predicted: np.ndarray, y_test: np.ndarray) -> np.ndarray:
        return -((y_test - np.asarray(predicted, dtype=np.float64).reshape(len(y_test))) ** 2)

    def fisher_labels(self, y, dtype: torch.dtype) -> torch.Tensor:
        return host_tensor(y, dtype)

    def summed_loss(self) -> nn.Module:
        return nn.MSELoss(reduction="sum")

    def loss_target(self, y: torch.Tensor) -> torch.Tensor:
        return y[:, None]

    def fisher_targets(
        self, model: nn.Module, X: Tensor, y: Tensor, kind: str, noise_std: float, rng: Generator
    ) -> Tensor:
        if kind == "sampled":
            with torch.no_grad():
                out = model(X)
            noise = torch.randn(out.shape[0], generator=rng, dtype=out.dtype, device=rng.device)
            y = out[:, 0] + noise_std * noise.to(out.device)
        return y[:, None]

    def exact_targets(self, model: nn.Module, X: torch.Tensor, noise_std: float) -> list[FisherTarget]:
        """A target one σ from the prediction: its squared score is (∇f)²/σ², E[(y−f)²] = σ² being the Fisher's."""
        with torch.no_grad():
            out = model(X)
        return [(out + noise_std, torch.ones(len(X), dtype=out.dtype, device=out.device))]

    def score_scale(self, noise_std: float) -> float:
        """MSE-sum (f−y)² has gradient 2(f−y)∇f and Hessian 2; the score is (y−f)∇f/σ², the Fisher ∇f∇fᵀ/σ²."""
        return 1.0 / (2 * noise_std**2)
