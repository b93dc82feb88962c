"""DARE (Yu et al. 2024): drop task-vector entries at random and rescale, then task arithmetic or TIES."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mergeflow.merge.registry import TaskVectors, TensorInputs, merge_method
from mergeflow.merge.sparsify import disjoint_mean, dropout_masks, tensor_generator
from mergeflow.merge.sums import running_sum
from mergeflow.schema.merge import DareOptions


def _drops(tasks: TaskVectors, shape: tuple[int, ...], name: str, options: DareOptions) -> Iterator[torch.Tensor]:
    return dropout_masks(len(tasks), shape, options.drop_rate, tensor_generator(options.seed, name, tasks.device))


def _dropped(x: TensorInputs, options: DareOptions) -> torch.Tensor:
    """The task vectors with the drawn entries dropped and the survivors rescaled by 1/(1 − p)."""
    assert x.base is not None and x.masks is not None  # needs base (schema), masks=
    tasks = x.stacked() - x.base
    if options.drop_rate == 0:
        return tasks
    return tasks.mul_(x.masks).div_(1.0 - options.drop_rate)


@merge_method("dare_linear", masks=_drops)
def dare_linear(x: TensorInputs, options: DareOptions) -> torch.Tensor:
    """DARE + task arithmetic: base + λ · Σ_k of the dropped-and-rescaled task vectors."""
    return x.base + options.scaling * running_sum(_dropped(x, options))


@merge_method("dare_ties", masks=_drops)
def dare_ties(x: TensorInputs, options: DareOptions) -> torch.Tensor:
    """DARE + TIES: base + λ · disjoint mean of the dropped-and-rescaled, sign-elected task vectors."""
    return x.base + options.scaling * disjoint_mean(_dropped(x, options), overwrite=True)
