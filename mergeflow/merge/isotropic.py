"""Isotropic merging (Marczak et al. 2025, "No Task Left Behind: Isotropic Model Merging with Common and
Task-Specific Subspaces"), as FusionBench's ``isotropic_merging`` (``ISO_C_Merge``, ``ISO_CTS_Merge``).

Iso-C, per 2-D tensor: the summed task matrix Σ_k Δ_k = U S Vᵀ is replaced by σ̄·U Vᵀ, σ̄ the mean
singular value, so that every direction of the common subspace gets the same weight; the merge is
base + α·σ̄ U Vᵀ.

Iso-CTS adds task-specific directions: the sum's top c singular vectors (c from
``common_space_fraction``, adjusted so that the remaining min(m, n) − c split evenly into K shares of s)
span the common subspace; each task's matrix, with that subspace projected out of its columns, gives
its top s singular triplets. All of them, concatenated and whitened (polar factors, as in TSV-M), get
the mean of their singular values: base + α·σ̄ U⊥ V⊥ᵀ.

Tensors that are not 2-D get base + α·mean_k Δ_k, as in FusionBench. Each tensor is merged on its own,
so both stream tensor by tensor; within a tensor the SVDs need all K task matrices whole.
"""

from __future__ import annotations

import torch

from mergeflow.errors import MergeflowError
from mergeflow.merge.engine import TensorInputs
from mergeflow.merge.spectral import add_scaled, is_matrix, mean_task, orthogonalised, task_matrices
from mergeflow.merge.sums import running_sum
from mergeflow.schema.merge import IsoCOptions, IsoCtsOptions


def iso_c_task_matrix(tasks: list[torch.Tensor]) -> torch.Tensor:
    """σ̄·U Vᵀ for Σ_k Δ_k = U S Vᵀ, σ̄ = mean(S)."""
    left, singular, right = torch.linalg.svd(running_sum(tasks), full_matrices=False)
    return (left @ right).mul_(singular.mean())


def subspace_sizes(rank: int, count: int, fraction: float) -> tuple[int, int]:
    """(c, s): the common subspace's size and each of the ``count`` tasks' share, c + count·s = ``rank``.

    FusionBench's rule: c = ⌊fraction·rank⌋, then s = round((rank − c)/count) (Python's half-to-even
    rounding) and c = rank − count·s. Where that rounding would leave c < 0 (a small matrix, many tasks,
    a small fraction; FusionBench then fails) s = ⌊rank/count⌋ instead.
    """
    common = int(rank * fraction)
    share = round((rank - common) / count)
    if count * share > rank:
        share = rank // count
    return rank - count * share, share


def iso_cts_task_matrix(tasks: list[torch.Tensor], fraction: float) -> torch.Tensor:
    """σ̄·U⊥ V⊥ᵀ over the common and the task-specific singular triplets (the module docstring)."""
    rank = min(tasks[0].shape)
    common, share = subspace_sizes(rank, len(tasks), fraction)
    left, singular, right = torch.linalg.svd(running_sum(tasks), full_matrices=False)
    common_left = left[:, :common]
    lefts, values, rights = [], [], []
    for task in tasks:
        specific = task - common_left @ (common_left.T @ task)
        task_left, task_singular, task_right = torch.linalg.svd(specific, full_matrices=False)
        lefts.append(task_left[:, :share])
        values.append(task_singular[:share])
        rights.append(task_right[:share, :])
    lefts.append(common_left)
    values.append(singular[:common])
    rights.append(right[:common, :])
    whitened = orthogonalised(torch.cat(lefts, dim=1)) @ orthogonalised(torch.cat(rights, dim=0))
    return whitened.mul_(torch.cat(values).mean())


def iso_c(x: TensorInputs, options: IsoCOptions) -> torch.Tensor:
    """Iso-C: the summed task matrix with its singular values flattened to their mean, added as base + α·σ̄UVᵀ."""
    if not is_matrix(x):
        return mean_task(x, options.scaling)
    return add_scaled(x, iso_c_task_matrix(task_matrices(x)), options.scaling)


def iso_cts(x: TensorInputs, options: IsoCtsOptions) -> torch.Tensor:
    """Iso-CTS: Iso-C over a common subspace plus each task's own directions, whitened together."""
    if len(x.tensors) < 2:
        raise MergeflowError(
            f"iso_cts merges at least 2 models (a common and task-specific subspaces), got {len(x.tensors)}"
        )
    if not is_matrix(x):
        return mean_task(x, options.scaling)
    return add_scaled(x, iso_cts_task_matrix(task_matrices(x), options.common_space_fraction), options.scaling)
