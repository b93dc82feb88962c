"""Fisher merging (Matena & Raffel): an elementwise precision-weighted average."""

from __future__ import annotations

import torch

from mergeflow.errors import MergeflowError
from mergeflow.merge.engine import TensorInputs
from mergeflow.schema.merge import FisherOptions


def fisher(x: TensorInputs, options: FisherOptions) -> torch.Tensor:
    """θ* = Σ λ_k F_k θ_k / Σ λ_k F_k, elementwise."""
    assert x.fishers is not None
    count = len(x.tensors)
    lam = torch.ones(count, dtype=torch.float64, device=x.weights.device)
    if options.coefficients is not None:
        if len(options.coefficients) != count:
            raise MergeflowError(f"fisher coefficients: {len(options.coefficients)} given for {count} models")
        lam = torch.as_tensor(options.coefficients, dtype=torch.float64, device=x.weights.device)
    if options.by_size:
        lam = lam * x.weights
    if options.normalize:
        lam = lam / x.fisher_norms.clamp_min(1e-30)
    weighted_sum, precision = torch.zeros_like(x.tensors[0]), torch.zeros_like(x.tensors[0])
    for scale, theta, f in zip(lam.tolist(), x.tensors, x.fishers, strict=True):
        term = f.clamp_min(options.floor).mul_(scale)
        precision += term
        weighted_sum.addcmul_(term, theta)
    return weighted_sum.div_(precision)
