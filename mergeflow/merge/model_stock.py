"""Model Stock (Jang et al. 2024): interpolate the average toward the base by the task vectors' angle."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import torch

from mergeflow.merge.registry import TaskVectors, TensorInputs, merge_method, task_vector
from mergeflow.merge.sums import mean


def stock_ratio(tasks: Sequence[torch.Tensor]) -> float:
    """t = K·cos θ / (1 + (K−1)·cos θ), cos θ the mean pairwise cosine of the K task vectors.

    ``tasks`` may compute each vector when indexed (``TaskVectors``): two are held at a time.
    """
    k = len(tasks)
    norms = [float(tasks[i].norm()) for i in range(k)]
    pairs = []
    for i, j in itertools.combinations(range(k), 2):
        scale = norms[i] * norms[j]
        pairs.append(float(tasks[i].reshape(-1) @ tasks[j].reshape(-1)) / scale if scale > 0 else 0.0)
    cos = sum(pairs) / len(pairs) if pairs else 1.0
    return k * cos / (1 + (k - 1) * cos) if 1 + (k - 1) * cos != 0 else 0.0


@merge_method("model_stock", needs=("base",))
def model_stock(x: TensorInputs, options: object) -> torch.Tensor:
    """Model Stock: t · average + (1 − t) · base per tensor, t from the task vectors' mean pairwise angle."""
    assert x.base is not None  # guaranteed by needs=("base",)
    ratio = stock_ratio(TaskVectors(len(x.tensors), functools.partial(task_vector, x.tensors, x.base)))
    return mean(x.tensors).mul_(ratio).add_(x.base, alpha=1 - ratio)
