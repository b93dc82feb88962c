"""Scores of a model's weights on one prepared split (validation, for choices that must not see test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from mergeflow.data.encode import target_scale
from mergeflow.models import build_from_spec
from mergeflow.objectives import get_objective
from mergeflow.training import predict
from tasks.layout import PREPARED
from tasks.prepared import read_arrays, read_info


def score_outputs(outputs: np.ndarray, y: np.ndarray, info: dict[str, Any], noise_std: float, n_bins: int = 15) -> dict:
    """Metrics of raw outputs against targets as the pipeline reports them: a regression model's MSE and
    NLL in the target's own units (its training target may have been standardised), with the data's
    own noise when it knows it."""
    noise = info.get("noise_std") or noise_std
    objective = get_objective(info["task"])
    metrics = objective.metrics(outputs, y, n_bins=n_bins, noise_std=noise)
    return objective.in_target_units(metrics, target_scale(info)["std"])


def split_metrics(
    root: Path,
    split: str,
    spec: dict[str, Any],
    state: dict[str, torch.Tensor],
    noise_std: float,
    prepared: str = PREPARED,
) -> dict[str, float]:
    """Accuracy/NLL/ECE (or MSE/NLL, in the target's units) of ``state`` on ``<prepared>/<split>.parquet`` (the
    prepared data, or one task's: ``prepared``)."""
    info = read_info(root, prepared)
    X, y = read_arrays(root / prepared / f"{split}.parquet", info)
    model = build_from_spec(spec).to(next(iter(state.values())).device)  # where the state is
    model.load_state_dict(state)
    return score_outputs(predict(model.eval(), X, task=info["task"]), y, info, noise_std)


def mean_scores(scores: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of several models' numeric metrics (a task's clients: its individual model's scores)."""
    keys = [key for key, value in scores[0].items() if isinstance(value, int | float) and not isinstance(value, bool)]
    return {key: float(np.mean([s[key] for s in scores])) for key in keys}
