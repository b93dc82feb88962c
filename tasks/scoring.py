"""Scores of a model's weights on one prepared split (validation, for choices that must not see test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mergeflow.evaluation import evaluate_outputs, in_target_units
from mergeflow.models import build_from_spec
from mergeflow.training import predict
from tasks.data import PREPARED, read_arrays, read_info


def split_metrics(
    root: Path, split: str, spec: dict[str, Any], state: dict[str, torch.Tensor], noise_std: float
) -> dict[str, float]:
    """Accuracy/NLL/ECE (or MSE/NLL, in the target's units) of ``state`` on ``data/prepared/<split>.parquet``."""
    info = read_info(root)
    X, y = read_arrays(root / PREPARED / f"{split}.parquet", info)
    model = build_from_spec(spec)
    model.load_state_dict(state)
    outputs = predict(model.eval(), X)
    metrics = evaluate_outputs(outputs, y, task=info["task"], noise_std=info.get("noise_std") or noise_std)
    if info["task"] == "regression":
        return in_target_units(metrics, info.get("target_scale", {"std": 1.0})["std"])
    return metrics
