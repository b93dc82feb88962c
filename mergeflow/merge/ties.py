"""TIES-merging (Yadav et al. 2023): trim, elect sign, disjoint merge."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mergeflow.merge.registry import TaskVectors, TensorInputs, merge_method
from mergeflow.merge.sparsify import magnitude_masks, masked_merge
from mergeflow.schema.merge import TiesOptions


def _trimmed(tasks: TaskVectors, shape: tuple[int, ...], name: str, options: TiesOptions) -> Iterator[torch.Tensor]:
    return magnitude_masks(tasks, options.density)


@merge_method("ties", masks=_trimmed, stored=True)
def ties(x: TensorInputs, options: TiesOptions) -> torch.Tensor:
    """TIES: base + λ · disjoint mean of the trimmed, sign-elected task vectors."""
    return masked_merge(x, options.scaling, "agreeing_mean")
