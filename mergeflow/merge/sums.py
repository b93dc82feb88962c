"""Running sums over the K clients' tensors, accumulated in place into one new tensor.

The linear methods (average, weighted, task arithmetic, Fisher) use these rather than a
``(K, ...)`` stack: one accumulator instead of a K-fold temporary, and the same arithmetic
whether a whole tensor is merged in memory or a block of it is streamed from files.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def running_sum(
    tensors: Sequence[torch.Tensor], coefficients: Sequence[float] | torch.Tensor | None = None
) -> torch.Tensor:
    """Σ_k c_k·t_k (every c_k = 1 without coefficients) as a new tensor, one term added at a time."""
    scales = [1.0] * len(tensors) if coefficients is None else [float(c) for c in coefficients]
    total = tensors[0] * scales[0]
    for tensor, scale in zip(tensors[1:], scales[1:], strict=True):
        total.add_(tensor, alpha=scale)
    return total


def mean(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """(1/K) Σ_k t_k as a new tensor."""
    return running_sum(tensors).div_(len(tensors))
