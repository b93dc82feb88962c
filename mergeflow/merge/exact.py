"""The exact Gaussian merge: the product of the clients' Gaussian posteriors.

θ* = (Σ_k Λ_k − (K−1)δI)⁻¹ Σ_k Λ_k θ_k with Λ_k = n_k(U_kᵀU_k + D_k) + δI, the prior
counted once. Solved by conjugate gradients over the whole flattened model with
matrix-free products, so a low-rank-plus-diagonal precision never becomes D × D, and
Jacobi-preconditioned by the exact diagonal of Σ Λ_k.
With no factors (U = 0) and δ = 0 it is the diagonal Fisher merge.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from mergeflow.merge.precision import client_precisions
from mergeflow.merge.registry import MergeResult, ModelInputs, merge_method


class ExactOptions(BaseModel):
    """Prior precision δ, whether precisions scale with data size, and the CG budget."""

    model_config = ConfigDict(extra="forbid")
    prior_precision: float = Field(1e-3, ge=0)
    by_size: bool = True
    max_iterations: int = Field(1000, ge=1)
    tolerance: float = Field(1e-12, gt=0)
    preconditioner: Literal["jacobi", "none"] = "jacobi"


def conjugate_gradient(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    rhs: torch.Tensor,
    start: torch.Tensor,
    *,
    inverse_diagonal: torch.Tensor | None = None,
    tolerance: float = 1e-12,
    max_iterations: int = 1000,
) -> tuple[torch.Tensor, list[float]]:
    """Preconditioned CG for an SPD operator; returns x and ‖b − Ax_i‖/‖b‖ after each iteration.

    Written out (rather than scipy's ``cg``) because the residual curve then costs no extra
    products with the operator, and the vectors stay torch tensors end to end.
    """
    x = start.clone()
    r = rhs - matvec(x)
    rhs_norm = float(rhs.norm()) or 1.0
    residuals: list[float] = []
    if float(r.norm()) <= tolerance * rhs_norm:
        return x, [float(r.norm()) / rhs_norm]
    z = r * inverse_diagonal if inverse_diagonal is not None else r
    p, rz = z.clone(), torch.dot(r, z)
    for _ in range(max_iterations):
        ap = matvec(p)
        alpha = rz / torch.dot(p, ap)
        x += alpha * p
        r -= alpha * ap
        residuals.append(float(r.norm()) / rhs_norm)
        if residuals[-1] <= tolerance:
            break
        z = r * inverse_diagonal if inverse_diagonal is not None else r
        rz_next = torch.dot(r, z)
        p = z + (rz_next / rz) * p
        rz = rz_next
    return x, residuals


@merge_method("exact", options=ExactOptions, needs=("fishers",), uses=("factors",), scope="model")
def exact(x: ModelInputs, options: ExactOptions) -> MergeResult:
    """Product of Gaussian posteriors, θ* = (Σ Λ_k)⁻¹ Σ Λ_k θ_k, by matrix-free CG."""
    clients = client_precisions(x, by_size=options.by_size)
    delta = options.prior_precision

    def system(v: torch.Tensor) -> torch.Tensor:
        return sum(c.matvec(v) for c in clients) + delta * v

    rhs = sum(c.matvec(c.theta) + delta * c.theta for c in clients)
    start = sum(w * c.theta for w, c in zip(x.weights, clients, strict=True))
    inverse_diagonal = None
    if options.preconditioner == "jacobi":
        inverse_diagonal = 1.0 / (sum(c.precision_diagonal() for c in clients) + delta).clamp_min(1e-30)
    theta, residuals = conjugate_gradient(
        system,
        rhs,
        start,
        inverse_diagonal=inverse_diagonal,
        tolerance=options.tolerance,
        max_iterations=options.max_iterations,
    )
    final = float((rhs - system(theta)).norm()) / (float(rhs.norm()) or 1.0)
    summary = {"cg_iterations": float(len(residuals)), "cg_relative_residual": final}
    return MergeResult(x.unflatten(theta), {"cg_relative_residual": residuals}, summary)
