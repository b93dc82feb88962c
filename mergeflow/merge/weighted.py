"""Data-size weighted averaging, FedAvg's aggregation rule."""

from __future__ import annotations

import torch

from mergeflow.merge.registry import TensorInputs, merge_method


@merge_method("weighted", needs=("sizes",))
def weighted(x: TensorInputs, options: object) -> torch.Tensor:
    """Weighted average Σ (n_k/N) θ_k."""
    return torch.tensordot(x.weights, torch.stack(x.tensors), dims=1)
