"""DARE (Yu et al. 2024): drop task-vector entries at random and rescale, then task arithmetic or TIES."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mergeflow.merge.registry import TaskVectors, TensorInputs, merge_method
from mergeflow.merge.sparsify import dropout_masks, masked_merge, tensor_generator
from mergeflow.schema.merge import DareOptions


def _drops(tasks: TaskVectors, shape: tuple[int, ...], name: str, options: DareOptions) -> Iterator[torch.Tensor]:
    generator = tensor_generator(options.seed, name, tasks.device)
    return dropout_masks(len(tasks), shape, options.drop_rate, generator, tasks.out)


def _merged(x: TensorInputs, options: DareOptions, combine: str) -> torch.Tensor:
    """base + λ · combine of the task vectors with the drawn entries dropped and the survivors rescaled
    by 1/(1 − p)."""
    return masked_merge(x, options.scaling, combine, 1.0 - options.drop_rate if options.drop_rate else None)


@merge_method("dare_linear", masks=_drops, stored=True)
def dare_linear(x: TensorInputs, options: DareOptions) -> torch.Tensor:
    """DARE + task arithmetic: base + λ · Σ_k of the dropped-and-rescaled task vectors."""
    return _merged(x, options, "sum")


@merge_method("dare_ties", masks=_drops, stored=True)
def dare_ties(x: TensorInputs, options: DareOptions) -> torch.Tensor:
    """DARE + TIES: base + λ · disjoint mean of the dropped-and-rescaled, sign-elected task vectors."""
    return _merged(x, options, "agreeing_mean")
