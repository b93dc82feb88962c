"""Uniform parameter averaging."""

from __future__ import annotations

import torch

from mergeflow.merge.registry import TensorInputs, merge_method
from mergeflow.merge.sums import mean


@merge_method("average", elementwise=True)
def average(x: TensorInputs, options: object) -> torch.Tensor:
    """Uniform average (1/K) Σ θ_k, ignoring data sizes."""
    return mean(x.tensors)
