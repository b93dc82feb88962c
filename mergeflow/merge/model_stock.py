"""Model Stock (Jang et al. 2024): interpolate the average toward the base by the task vectors' angle."""

from __future__ import annotations

import itertools
import math

import torch

from mergeflow.merge.engine import TensorInputs
from mergeflow.merge.sums import mean


def stock_ratio(gram: torch.Tensor) -> float:
    """t = K·cos θ / (1 + (K−1)·cos θ), cos θ the mean pairwise cosine of the K task vectors, from their
    K × K Gram matrix."""
    k = gram.shape[0]
    norms = [math.sqrt(max(float(gram[i, i]), 0.0)) for i in range(k)]
    pairs = []
    for i, j in itertools.combinations(range(k), 2):
        scale = norms[i] * norms[j]
        pairs.append(float(gram[i, j]) / scale if scale > 0 else 0.0)
    cos = sum(pairs) / len(pairs) if pairs else 1.0
    return k * cos / (1 + (k - 1) * cos) if 1 + (k - 1) * cos != 0 else 0.0


def model_stock(x: TensorInputs, options: object) -> torch.Tensor:
    """Model Stock: t · average + (1 − t) · base per tensor, t from the task vectors' mean pairwise angle."""
    assert x.base is not None and x.gram is not None  # needs base (schema), gram=
    ratio = stock_ratio(x.gram)
    return mean(x.tensors).mul_(ratio).add_(x.base, alpha=1 - ratio)
