"""Quadratic client losses and the algebra of Gaussian precisions, elementwise or full.

A quadratic client loss ℓ_k(θ) = ½ θᵀH_kθ − b_kᵀθ (+ const) over its n_k examples, with θ a flat
vector stored under the parameter name ``"theta"`` and ``H_k`` a full (P, P) matrix or a diagonal
given as a (P,) vector; the algorithms' closed-form client steps read it, and
:mod:`mergeflow.federated.quadratic` runs rounds of them. Nothing here knows an algorithm, so the
algorithms and their interface (:mod:`mergeflow.federated.base`) import it without a circle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

THETA = "theta"


@dataclass(frozen=True)
class QuadraticProblem:
    """ℓ(θ) = ½θᵀHθ − bᵀθ with H a (P, P) matrix or a (P,) diagonal, over ``n`` examples."""

    H: torch.Tensor
    b: torch.Tensor
    n: int = 1

    def __post_init__(self) -> None:
        H = torch.as_tensor(self.H, dtype=torch.float64)
        b = torch.as_tensor(self.b, dtype=torch.float64).reshape(-1)
        if H.shape != b.shape and H.shape != (b.numel(), b.numel()):
            raise ValueError(f"H has shape {tuple(H.shape)}; expected ({b.numel()},) or ({b.numel()}, {b.numel()})")
        object.__setattr__(self, "H", H)
        object.__setattr__(self, "b", b)

    @property
    def dim(self) -> int:
        """Number of parameters P."""
        return self.b.numel()

    def loss(self, theta: torch.Tensor) -> float:
        """ℓ(θ) without the constant."""
        return float(0.5 * theta @ pmul(self.H, theta) - self.b @ theta)

    def minimiser(self) -> torch.Tensor:
        """H⁻¹b."""
        return psolve(self.H, self.b)


def scalar_problem(values: Sequence[float]) -> QuadraticProblem:
    """ℓ(θ) = ½ Σ_i (θ − x_i)² for scalar data x (the slides' toy): H = N, b = Σx."""
    x = torch.as_tensor(values, dtype=torch.float64)
    return QuadraticProblem(H=torch.tensor([float(len(x))], dtype=torch.float64), b=x.sum().reshape(1), n=len(x))


def linear_gaussian_problem(X: torch.Tensor, y: torch.Tensor, noise_std: float) -> QuadraticProblem:
    """Negative log-likelihood of y = Xθ + N(0, σ²): H = XᵀX/σ², b = Xᵀy/σ²."""
    X = torch.as_tensor(X, dtype=torch.float64)
    y = torch.as_tensor(y, dtype=torch.float64).reshape(-1)
    var = float(noise_std) ** 2
    return QuadraticProblem(H=X.T @ X / var, b=X.T @ y / var, n=X.shape[0])


def pmul(S: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """S·m for a precision S that is elementwise (same shape as m) or a full matrix over m flattened."""
    if S.shape == m.shape:
        return S * m
    return (S @ m.reshape(-1)).reshape(m.shape)


def psolve(S: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """S⁻¹·r for an elementwise or full precision S (see :func:`pmul`)."""
    if S.shape == r.shape:
        return r / S
    return torch.linalg.solve(S, r.reshape(-1)).reshape(r.shape)


def eye_like(S: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The identity in the layout of precision S over parameters ``like``: ones when S is elementwise
    (same shape as ``like``), else the (P, P) identity matrix."""
    if S.shape == like.shape:
        return torch.ones_like(S)
    return torch.eye(like.numel(), dtype=S.dtype, device=S.device)


def as_full(S: torch.Tensor) -> torch.Tensor:
    """A (P,) diagonal as a (P, P) matrix; a matrix unchanged."""
    return torch.diag(S) if S.dim() == 1 else S
