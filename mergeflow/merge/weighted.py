"""Data-size weighted averaging, FedAvg's aggregation rule."""

from __future__ import annotations

import torch

from mergeflow.merge.registry import merge_method


@merge_method("weighted", needs=("weights",))
def weighted(
    tensors: list[torch.Tensor], *, base: torch.Tensor | None, weights: torch.Tensor, options: object
) -> torch.Tensor:
    """Weighted average Σ (n_k/N) θ_k."""
    stacked = torch.stack(tensors)
    return torch.tensordot(weights, stacked, dims=1)
