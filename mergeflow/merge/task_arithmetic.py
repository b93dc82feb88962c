"""Task arithmetic: add the scaled sum of task vectors to the base model."""

from __future__ import annotations

import torch

from mergeflow.merge.engine import TensorInputs
from mergeflow.merge.sums import running_sum
from mergeflow.schema.merge import TaskArithmeticOptions


def task_arithmetic(x: TensorInputs, options: TaskArithmeticOptions) -> torch.Tensor:
    """base + λ·Σ_k (θ_k − base)."""
    assert x.base is not None  # needed, per mergeflow.schema.merge
    tasks = running_sum(x.tensors).sub_(x.base, alpha=len(x.tensors))
    return tasks.mul_(options.scaling).add_(x.base)
