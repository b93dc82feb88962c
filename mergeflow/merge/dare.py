"""DARE (Yu et al. 2024): drop task-vector entries at random and rescale, then task arithmetic or TIES."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from mergeflow.merge.registry import TensorInputs, merge_method
from mergeflow.merge.sparsify import disjoint_mean, drop_and_rescale, tensor_generator


class DareOptions(BaseModel):
    """``drop_rate``: p, each entry's drop probability (survivors scaled by 1/(1−p)); ``scaling``: λ;
    ``seed``: the draws, derived per tensor from it and the tensor's name."""

    model_config = ConfigDict(extra="forbid")
    drop_rate: float = Field(0.9, ge=0, lt=1)
    scaling: float = 1.0
    seed: int = 0


def _dropped(x: TensorInputs, options: DareOptions) -> torch.Tensor:
    assert x.base is not None  # guaranteed by needs=("base",)
    generator = tensor_generator(options.seed, x.name)
    return drop_and_rescale(x.stacked() - x.base, options.drop_rate, generator)


@merge_method("dare_linear", options=DareOptions, needs=("base",))
def dare_linear(x: TensorInputs, options: DareOptions) -> torch.Tensor:
    """DARE + task arithmetic: base + λ · Σ_k of the dropped-and-rescaled task vectors."""
    return x.base + options.scaling * _dropped(x, options).sum(dim=0)


@merge_method("dare_ties", options=DareOptions, needs=("base",))
def dare_ties(x: TensorInputs, options: DareOptions) -> torch.Tensor:
    """DARE + TIES: base + λ · disjoint mean of the dropped-and-rescaled, sign-elected task vectors."""
    return x.base + options.scaling * disjoint_mean(_dropped(x, options))
