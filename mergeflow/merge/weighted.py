"""Data-size weighted averaging, FedAvg's aggregation rule."""

from __future__ import annotations

import torch

from mergeflow.merge.engine import TensorInputs
from mergeflow.merge.sums import running_sum


def weighted(x: TensorInputs, options: object) -> torch.Tensor:
    """Weighted average Σ (n_k/N) θ_k."""
    return running_sum(x.tensors, x.weights)
