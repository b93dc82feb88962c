"""Uniform parameter averaging."""

from __future__ import annotations

import torch

from mergeflow.merge.registry import merge_method


@merge_method("average")
def average(
    tensors: list[torch.Tensor], *, base: torch.Tensor | None, weights: torch.Tensor, options: object
) -> torch.Tensor:
    """Uniform average (1/K) Σ θ_k, ignoring data sizes."""
    return torch.stack(tensors).mean(dim=0)
