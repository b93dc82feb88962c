"""Uniform parameter averaging."""

from __future__ import annotations

import torch

from mergeflow.merge.registry import TensorInputs, merge_method


@merge_method("average")
def average(x: TensorInputs, options: object) -> torch.Tensor:
    """Uniform average (1/K) Σ θ_k, ignoring data sizes."""
    return torch.stack(x.tensors).mean(dim=0)
