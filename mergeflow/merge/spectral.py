"""Shared steps of the spectral merges (TSV-M, Iso-C, Iso-CTS): task matrices, their SVDs, whitening.

These merges act on the 2-D tensors (weight matrices) through their singular vectors and give every
other tensor (biases, norms, convolution kernels) the task vectors' mean, as FusionBench does.
"""

from __future__ import annotations

import torch

from mergeflow.merge.engine import TensorInputs
from mergeflow.merge.sums import mean


def task_matrices(x: TensorInputs) -> list[torch.Tensor]:
    """The K task vectors θ_k − base of one tensor, as new tensors."""
    assert x.base is not None  # the spectral merges need base (mergeflow.schema.merge)
    return [tensor - x.base for tensor in x.tensors]


def is_matrix(x: TensorInputs) -> bool:
    """Whether the tensor is a 2-D weight matrix (the SVD applies); FusionBench's ``len(shape) == 2``."""
    return x.tensors[0].dim() == 2


def add_scaled(x: TensorInputs, merged_task: torch.Tensor, scaling: float) -> torch.Tensor:
    """base + α·merged task vector."""
    assert x.base is not None
    return merged_task.mul_(scaling).add_(x.base)


def mean_task(x: TensorInputs, scaling: float) -> torch.Tensor:
    """base + α·(1/K)Σ_k τ_k: how the spectral merges combine a tensor that is not a matrix."""
    return add_scaled(x, mean(task_matrices(x)), scaling)


def orthogonalised(matrix: torch.Tensor) -> torch.Tensor:
    """The polar factor P Qᵀ of ``matrix`` = P Σ Qᵀ (its thin SVD): the nearest matrix with orthonormal
    columns (or rows, if wide) in Frobenius norm. TSV-M and Iso-CTS whiten concatenated singular
    vectors with it, so that the tasks' directions stop overlapping."""
    left, _, right = torch.linalg.svd(matrix, full_matrices=False)
    return left @ right
