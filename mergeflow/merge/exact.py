"""The exact Gaussian merge: the product of the clients' Gaussian posteriors.

θ* = (Σ_k Λ_k − (K−1)δI)⁻¹ Σ_k Λ_k θ_k with Λ_k = n_k(U_kᵀU_k + D_k) + δI, the prior
counted once. Solved by conjugate gradients over the whole flattened model with
matrix-free products, so a low-rank-plus-diagonal precision never becomes D × D.
With no factors (U = 0) and δ = 0 it is the diagonal Fisher merge.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from scipy.sparse.linalg import LinearOperator, cg

from mergeflow.merge.precision import client_precisions
from mergeflow.merge.registry import MergeResult, ModelInputs, merge_method


class ExactOptions(BaseModel):
    """Prior precision δ, whether precisions scale with data size, and the CG budget."""

    model_config = ConfigDict(extra="forbid")
    prior_precision: float = Field(1e-3, ge=0)
    by_size: bool = True
    max_iterations: int = Field(1000, ge=1)
    tolerance: float = Field(1e-12, gt=0)


@merge_method("exact", options=ExactOptions, needs=("fishers",), scope="model")
def exact(x: ModelInputs, options: ExactOptions) -> MergeResult:
    """Product of Gaussian posteriors, θ* = (Σ Λ_k)⁻¹ Σ Λ_k θ_k, by matrix-free CG."""
    clients = client_precisions(x, by_size=options.by_size)
    delta = options.prior_precision
    dim = clients[0].theta.numel()

    def system(v: torch.Tensor) -> torch.Tensor:
        return sum(c.matvec(v) for c in clients) + delta * v

    rhs = sum(c.matvec(c.theta) + delta * c.theta for c in clients)
    operator = LinearOperator((dim, dim), matvec=lambda v: system(torch.from_numpy(v)).numpy(), dtype=np.float64)
    start = sum(w * c.theta for w, c in zip(x.weights, clients, strict=True))
    rhs_norm = float(rhs.norm()) or 1.0
    residuals: list[float] = []

    def record(xk: np.ndarray) -> None:
        residuals.append(float((rhs - system(torch.from_numpy(xk))).norm()) / rhs_norm)

    solution, _ = cg(operator, rhs.numpy(), x0=start.numpy(), rtol=options.tolerance, atol=0.0,
                     maxiter=options.max_iterations, callback=record)
    theta = torch.from_numpy(solution)
    final = float((rhs - system(theta)).norm()) / rhs_norm
    summary = {"cg_iterations": float(len(residuals)), "cg_relative_residual": final}
    return MergeResult(x.unflatten(theta), {"cg_relative_residual": residuals}, summary)
