"""Uniform parameter averaging."""

from __future__ import annotations

import torch

from mergeflow.merge.engine import TensorInputs
from mergeflow.merge.sums import mean


def average(x: TensorInputs, options: object) -> torch.Tensor:
    """Uniform average (1/K) Σ θ_k, ignoring data sizes."""
    return mean(x.tensors)
