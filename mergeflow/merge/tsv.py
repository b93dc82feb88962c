"""TSV-M (Gargiulo et al. 2025, "Task Singular Vectors"): low-rank task matrices, whitened so that they
stop interfering, as FusionBench's ``task_singular_vector`` (``TaskSingularVectorMerging``).

For each 2-D tensor, with task matrices Δ_k = θ_k − base:

1. Δ_k = U_k Σ_k V_kᵀ (thin SVD); keep the top r_k = ⌊f·min(m, n)⌋ singular triplets (f = 1/K by default);
2. concatenate U = [U_1 … U_K], Σ = diag(Σ_1 … Σ_K), V = [V_1 … V_K];
3. whiten: U⊥ = P Qᵀ from the SVD U = P S Qᵀ (the nearest orthonormal columns), likewise V⊥;
4. merged = base + α·U⊥ Σ V⊥ᵀ.

Every other tensor (biases, norms, 4-D convolution kernels, as FusionBench treats any tensor whose
shape is not 2-D) gets base + α·mean_k Δ_k. Each tensor is merged on its own, so the merge streams
tensor by tensor; within a tensor the SVDs need all K task matrices whole.
"""

from __future__ import annotations

import torch

from mergeflow.merge.engine import TensorInputs
from mergeflow.merge.spectral import add_scaled, is_matrix, mean_task, orthogonalised, task_matrices
from mergeflow.schema.merge import TsvOptions


def kept_rank(shape: tuple[int, ...], fraction: float) -> int:
    """Singular triplets kept per task: ⌊fraction·min(m, n)⌋ as FusionBench's ``int(s.shape[0] * fraction)``,
    but at least 1 (FusionBench keeps none, a zero update, when a matrix's rank is below K)."""
    return max(1, int(min(shape) * fraction))


def tsv_task_matrix(tasks: list[torch.Tensor], fraction: float) -> torch.Tensor:
    """U⊥ Σ V⊥ᵀ from the task matrices' top singular triplets (steps 1-3 of the module docstring)."""
    rank = kept_rank(tuple(tasks[0].shape), fraction)
    lefts, values, rights = [], [], []
    for task in tasks:
        left, singular, right = torch.linalg.svd(task, full_matrices=False)
        lefts.append(left[:, :rank])
        values.append(singular[:rank])
        rights.append(right[:rank, :])
    left = orthogonalised(torch.cat(lefts, dim=1))
    right = orthogonalised(torch.cat(rights, dim=0))
    return (left * torch.cat(values)) @ right


def tsv(x: TensorInputs, options: TsvOptions) -> torch.Tensor:
    """TSV-M: each task matrix's top singular vectors, whitened together, added as base + α·U⊥ΣV⊥ᵀ."""
    if not is_matrix(x):
        return mean_task(x, options.scaling)
    fraction = options.rank_fraction if options.rank_fraction is not None else 1.0 / len(x.tensors)
    return add_scaled(x, tsv_task_matrix(task_matrices(x), fraction), options.scaling)
