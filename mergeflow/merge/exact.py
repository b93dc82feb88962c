"""The exact Gaussian merge: the product of the clients' Gaussian posteriors.

θ* = (Σ_k Λ_k − (K−1)δI)⁻¹ (Σ_k Λ_k θ_k − (K−1)δθ₀) with Λ_k = n_k(U_kᵀU_k + D_k) + δI: every
client's posterior holds the prior N(θ₀, δ⁻¹I), which the product counts once. The prior mean θ₀
is the shared base model the clients were fine-tuned from (``prior_mean: base``), or zero
(``zero``, the prior of SSF's linear reproduction). It matters where the data say nothing: there
θ* = θ₀ + Σ_k (θ_k − θ₀), so a zero prior mean would return K times a pretrained weight that no
client's data touched (an unseen token's embedding, say). Solved by conjugate gradients over the
whole flattened model with matrix-free products, so a low-rank-plus-diagonal precision never
becomes D × D.

The default preconditioner inverts Σ Λ_k exactly by Woodbury: it is a diagonal plus the
stacked factors of all clients (R rows in all), so one R × R Cholesky factor, built once at
O(R²D), makes CG converge in a few iterations even when zero-Fisher coordinates leave only
the prior precision there (condition numbers of 1e6 and more, where Jacobi-preconditioned CG
needs thousands of iterations). When the clients' rows outnumber the parameters (a thousand clients
of a small model) the same inverse is the dense D × D matrix's, built at O(RD²): either way linear in the
clients. ``jacobi`` (the diagonal of Σ Λ_k) and ``none`` remain for models whose min(R, D)² is too large.
With no factors (U = 0) and δ = 0 it is the diagonal Fisher merge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mergeflow import cancel
from mergeflow.merge.engine import MergeResult, ModelInputs
from mergeflow.merge.precision import ClientPrecision, client_precisions, prior_mean
from mergeflow.schema.merge import ExactOptions


def conjugate_gradient(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    rhs: torch.Tensor,
    start: torch.Tensor,
    *,
    preconditioner: Callable[[torch.Tensor], torch.Tensor] | None = None,
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
    z = preconditioner(r) if preconditioner is not None else r
    p, rz = z.clone(), torch.dot(r, z)
    for _ in range(max_iterations):
        cancel.check()
        ap = matvec(p)
        alpha = rz / torch.dot(p, ap)
        x += alpha * p
        r -= alpha * ap
        residuals.append(float(r.norm()) / rhs_norm)
        if residuals[-1] <= tolerance:
            break
        z = preconditioner(r) if preconditioner is not None else r
        rz_next = torch.dot(r, z)
        p = z + (rz_next / rz) * p
        rz = rz_next
    return x, residuals


def _preconditioner(
    kind: str, clients: list[ClientPrecision], delta: float
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    if kind == "none":
        return None
    if kind == "jacobi":
        inverse_diagonal = 1.0 / (sum(c.precision_diagonal() for c in clients) + delta).clamp_min(1e-30)
        return lambda r: r * inverse_diagonal
    return woodbury_preconditioner(clients, delta)


def woodbury_preconditioner(
    clients: list[ClientPrecision], delta: float, build_dtype: torch.dtype = torch.float64
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The exact inverse of Σ_k Λ_k − (K−1)δI (each Λ_k = s_k(U_kᵀU_k + D_k) + δI): by Woodbury in the R × R
    space of the stacked factor rows, or, when the clients' rows outnumber the D parameters (many clients of a
    small model), as the dense D × D matrix, so that its cost grows linearly with the clients (R D², not R² D)."""
    diagonal = sum(c.diagonal for c in clients) + delta
    if sum(len(c.factors) for c in clients) > diagonal.numel():
        return dense_inverse(diagonal, clients)
    return woodbury_inverse(diagonal, clients, build_dtype=build_dtype)


def dense_inverse(diagonal: torch.Tensor, clients: list[ClientPrecision]) -> Callable[[torch.Tensor], torch.Tensor]:
    """v ↦ (A + Σ_k s_k U_kᵀU_k)⁻¹ v for a positive diagonal A, from the D × D matrix's Cholesky factor in float64
    (its factors summed a block of rows at a time)."""
    matrix = torch.diag(diagonal.to(torch.float64))
    for c in clients:
        cancel.check()
        for rows in torch.split(c.factors, 4096):
            wide = rows.to(torch.float64)
            matrix.addmm_(wide.T, wide, alpha=c.factor_scale)
    cholesky = torch.linalg.cholesky(matrix)
    return lambda v: torch.cholesky_solve(v.to(torch.float64)[:, None], cholesky)[:, 0]


def woodbury_inverse(
    diagonal: torch.Tensor,
    clients: list[ClientPrecision],
    columns: int = 1 << 15,
    strip: int = 128,
    build_dtype: torch.dtype = torch.float64,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """v ↦ (A + Σ_k s_k U_kᵀU_k)⁻¹ v for a positive diagonal A and the clients' scaled factors, by Woodbury.

    (A + SᵀS)⁻¹ = A⁻¹ − A⁻¹Sᵀ (I + S A⁻¹ Sᵀ)⁻¹ S A⁻¹ with S the stacked √s_k U_k. The R × R
    capacitance is summed and factored in float64 from products in ``build_dtype``. Float64 makes it
    exact to rounding (CG then stops after one or two iterations). Float32 products take half the
    time, and the capacitance they make differs from it by 2e-4 at 1M parameters, but their rounding
    of S A^(-1/2), relative to the capacitance's largest eigenvalue (about 1e6), costs CG 1 to 4 more
    iterations: at the default tolerance more than the build saves (``bench/woodbury_precision.py``,
    docs/benchmarks.md). Each block of ``columns`` columns of S A^(-1/2) is scaled once into a
    reused buffer, and only the lower triangle is multiplied, in strips of ``strip`` rows (0.58 of
    the full product's time). Applying it is float64 whatever the build: in float32 its two terms
    cancel, and CG took about 100 iterations at 1M parameters. It costs two passes over the
    factors, widened by row blocks like the CG products.
    """
    inverse_a = 1.0 / diagonal.clamp_min(1e-30)
    root_inverse = inverse_a.sqrt().to(build_dtype)
    rows = sum(len(c.factors) for c in clients)
    capacitance = torch.zeros(rows, rows, dtype=torch.float64, device=diagonal.device)
    block = torch.empty(rows, min(columns, diagonal.numel()), dtype=build_dtype, device=diagonal.device)
    product = torch.empty(min(strip, rows), rows, dtype=build_dtype, device=diagonal.device)
    for start in range(0, diagonal.numel(), columns):
        cancel.check()
        stop = min(start + columns, diagonal.numel())
        scaled = block[:, : stop - start]
        offset = 0
        for c in clients:
            part = scaled[offset : offset + len(c.factors)].copy_(c.factors[:, start:stop])
            part.mul_(root_inverse[start:stop]).mul_(c.factor_scale**0.5)
            offset += len(c.factors)
        for first in range(0, rows, strip):
            last = min(first + strip, rows)
            torch.mm(scaled[first:last], scaled[:last].T, out=product[: last - first, :last])
            capacitance[first:last, :last] += product[: last - first, :last]
    identity = torch.eye(rows, dtype=torch.float64, device=diagonal.device)
    capacitance = capacitance.tril() + capacitance.tril(-1).T + identity
    cholesky = torch.linalg.cholesky(capacitance)

    def apply(v: torch.Tensor) -> torch.Tensor:
        scaled = inverse_a * v
        projected = torch.cat([c.project(scaled) for c in clients])
        weights = torch.cholesky_solve(projected[:, None], cholesky)[:, 0]
        correction = torch.zeros_like(scaled)
        offset = 0
        for c in clients:
            c.lift(weights[offset : offset + len(c.factors)], into=correction)
            offset += len(c.factors)
        return scaled - inverse_a * correction

    return apply


@dataclass(frozen=True)
class ProductSystem:
    """The exact merge's linear system (Σ Λ_k − (K−1)δI) θ = rhs, with CG's start and the clients' precisions."""

    clients: list[ClientPrecision]
    delta: float
    rhs: torch.Tensor
    start: torch.Tensor

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """(Σ Λ_k − (K−1)δI) v, matrix-free."""
        return sum(c.matvec(v) for c in self.clients) + self.delta * v

    def relative_residual(self, theta: torch.Tensor) -> float:
        """‖rhs − Aθ‖ / ‖rhs‖, with one exact product."""
        return float((self.rhs - self.matvec(theta)).norm()) / (float(self.rhs.norm()) or 1.0)


def product_system(x: ModelInputs, options: ExactOptions) -> ProductSystem:
    """The linear system whose solution is the product of the clients' Gaussian posteriors; CG starts
    from the clients' weighted average."""
    clients = client_precisions(x, by_size=options.by_size)
    delta = options.prior_precision
    theta0 = prior_mean(x, options.prior_mean)
    rhs = sum(c.matvec(c.theta) + delta * c.theta for c in clients) - (len(clients) - 1) * delta * theta0
    start = sum(w * c.theta for w, c in zip(x.weights, clients, strict=True))
    return ProductSystem(clients, delta, rhs, start)


def exact(x: ModelInputs, options: ExactOptions) -> MergeResult:
    """Product of Gaussian posteriors, θ* = (Σ Λ_k − (K−1)δ)⁻¹ (Σ Λ_k θ_k − (K−1)δθ₀), by matrix-free CG."""
    system = product_system(x, options)
    theta, residuals = conjugate_gradient(
        system.matvec,
        system.rhs,
        system.start,
        preconditioner=_preconditioner(options.preconditioner, system.clients, system.delta),
        tolerance=options.tolerance,
        max_iterations=options.max_iterations,
    )
    summary = {"cg_iterations": float(len(residuals)), "cg_relative_residual": system.relative_residual(theta)}
    return MergeResult(x.unflatten(theta), {"cg_relative_residual": residuals}, summary)
