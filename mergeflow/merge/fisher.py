"""Fisher merging (Matena & Raffel): an elementwise precision-weighted average."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from mergeflow.errors import MergeflowError
from mergeflow.merge.registry import TensorInputs, merge_method


class FisherOptions(BaseModel):
    """How the clients' diagonal Fishers F_k weight their parameters.

    ``by_size`` multiplies F_k (an average over examples) by n_k/N, so the weights are the
    clients' data precisions, as in a product of Gaussian posteriors. ``coefficients`` are
    explicit λ_k; ``normalize`` divides λ_k by the global L2 norm of F_k; ``floor`` keeps a
    parameter that no client has information about from dividing by zero.
    """

    model_config = ConfigDict(extra="forbid")
    coefficients: list[float] | None = None
    by_size: bool = True
    normalize: bool = False
    floor: float = Field(1e-8, ge=0)


@merge_method("fisher", options=FisherOptions, needs=("fishers",), elementwise=True)
def fisher(x: TensorInputs, options: FisherOptions) -> torch.Tensor:
    """θ* = Σ λ_k F_k θ_k / Σ λ_k F_k, elementwise."""
    assert x.fishers is not None
    count = len(x.tensors)
    lam = torch.ones(count, dtype=torch.float64)
    if options.coefficients is not None:
        if len(options.coefficients) != count:
            raise MergeflowError(f"fisher coefficients: {len(options.coefficients)} given for {count} models")
        lam = torch.as_tensor(options.coefficients, dtype=torch.float64)
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
