"""TIES-merging (Yadav et al. 2023): trim, elect sign, disjoint merge."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mergeflow.merge.engine import TaskVectors, TensorInputs
from mergeflow.merge.sparsify import magnitude_masks, masked_merge
from mergeflow.schema.merge import TiesOptions


def masks(tasks: TaskVectors, shape: tuple[int, ...], name: str, options: TiesOptions) -> Iterator[torch.Tensor]:
    """TIES' trim: each task vector's ``density`` fraction of largest magnitudes (the declaration's ``masks``)."""
    return magnitude_masks(tasks, options.density)


def ties(x: TensorInputs, options: TiesOptions) -> torch.Tensor:
    """TIES: base + λ · disjoint mean of the trimmed, sign-elected task vectors."""
    return masked_merge(x, options.scaling, "agreeing_mean")
