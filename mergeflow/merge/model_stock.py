"""Model Stock (Jang et al. 2024): interpolate the average toward the base by the task vectors' angle."""

from __future__ import annotations

import itertools

import torch

from mergeflow.merge.registry import TensorInputs, merge_method


def stock_ratio(tasks: torch.Tensor) -> float:
    """t = K·cos θ / (1 + (K−1)·cos θ), cos θ the mean pairwise cosine of the K task vectors ``(K, ...)``."""
    flat = tasks.reshape(tasks.shape[0], -1)
    norms = flat.norm(dim=1)
    pairs = [
        float(flat[i] @ flat[j] / (norms[i] * norms[j])) if norms[i] * norms[j] > 0 else 0.0
        for i, j in itertools.combinations(range(len(flat)), 2)
    ]
    cos = sum(pairs) / len(pairs) if pairs else 1.0
    k = len(flat)
    return k * cos / (1 + (k - 1) * cos) if 1 + (k - 1) * cos != 0 else 0.0


@merge_method("model_stock", needs=("base",))
def model_stock(x: TensorInputs, options: object) -> torch.Tensor:
    """Model Stock: t · average + (1 − t) · base per tensor, t from the task vectors' mean pairwise angle."""
    assert x.base is not None  # guaranteed by needs=("base",)
    stacked = x.stacked()
    ratio = stock_ratio(stacked - x.base)
    return ratio * stacked.mean(dim=0) + (1 - ratio) * x.base
