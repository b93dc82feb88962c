"""Model Breadcrumbs (Davari & Belilovsky 2024): drop each task vector's outliers and its smallest entries.

As mergekit's ``breadcrumbs`` (task arithmetic of the masked task vectors) and ``breadcrumbs_ties``
(the same with TIES' sign election), including mergekit's ``normalize``. Streams in blocks: the masks
need each whole task vector once, then the merge is elementwise.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mergeflow.merge.engine import TaskVectors, TensorInputs
from mergeflow.merge.sparsify import masked_merge, outlier_masks
from mergeflow.schema.merge import BreadcrumbsOptions


def masks(tasks: TaskVectors, shape: tuple[int, ...], name: str, options: BreadcrumbsOptions) -> Iterator[torch.Tensor]:
    """Breadcrumbs' masks: the ``gamma`` outliers and the smallest rest dropped (the declaration's ``masks``)."""
    return outlier_masks(tasks, options.density, options.gamma)


def breadcrumbs(x: TensorInputs, options: BreadcrumbsOptions) -> torch.Tensor:
    """Breadcrumbs: base + λ · Σ_k (or the mean, ``normalize``) of the task vectors without outliers and smallest."""
    return masked_merge(x, options.scaling / len(x.tensors) if options.normalize else options.scaling, "sum")


def breadcrumbs_ties(x: TensorInputs, options: BreadcrumbsOptions) -> torch.Tensor:
    """Breadcrumbs + TIES: base + λ · the sum (or mean, ``normalize``) of the sign-agreeing masked entries."""
    return masked_merge(x, options.scaling, "agreeing_mean" if options.normalize else "agreeing_sum")
