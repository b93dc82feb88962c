"""DARE (Yu et al. 2024): drop task-vector entries at random and rescale, then task arithmetic or TIES."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mergeflow.merge.engine import TaskVectors, TensorInputs
from mergeflow.merge.sparsify import dropout_masks, masked_merge, tensor_generator
from mergeflow.schema.merge import DareOptions


def masks(tasks: TaskVectors, shape: tuple[int, ...], name: str, options: DareOptions) -> Iterator[torch.Tensor]:
    """DARE's drops: each entry dropped with probability ``drop_rate`` (the declaration's ``masks``)."""
    generator = tensor_generator(options.seed, name, tasks.device)
    return dropout_masks(len(tasks), shape, options.drop_rate, generator, tasks.out)


def _merged(x: TensorInputs, options: DareOptions, combine: str) -> torch.Tensor:
    """base + λ · combine of the task vectors with the drawn entries dropped and the survivors rescaled
    by 1/(1 − p)."""
    return masked_merge(x, options.scaling, combine, 1.0 - options.drop_rate if options.drop_rate else None)


def dare_linear(x: TensorInputs, options: DareOptions) -> torch.Tensor:
    """DARE + task arithmetic: base + λ · Σ_k of the dropped-and-rescaled task vectors."""
    return _merged(x, options, "sum")


def dare_ties(x: TensorInputs, options: DareOptions) -> torch.Tensor:
    """DARE + TIES: base + λ · disjoint mean of the dropped-and-rescaled, sign-elected task vectors."""
    return _merged(x, options, "agreeing_mean")
