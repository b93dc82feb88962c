"""Client precisions Λ_k = s_k (U_kᵀU_k + D_k) + δI over the flattened model, never formed.

U_k are per-client Fisher factors (F ≈ UᵀU, averaged over examples), D_k the rest of the
diagonal Fisher not explained by U_k, s_k the client's data size and δ the prior
precision (counted once in a product of posteriors). Shared by the exact and SSF merges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mergeflow.errors import MergeflowError
from mergeflow.merge.registry import ModelInputs

# Factor rows widened to float64 at once: bounds the temporaries for large models.
_ROW_BLOCK = 64


@dataclass(frozen=True)
class ClientPrecision:
    """The data part s(UᵀU + D) of one client's precision, plus its mean θ_k."""

    theta: torch.Tensor
    factors: torch.Tensor  # (rows, D), already scaled by √s; float32 or float64
    diagonal: torch.Tensor  # (D,), already scaled by s

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """(s(UᵀU + D)) v in float64 without forming a D × D matrix.

        Float32 factors are widened a block of rows at a time: products in float32 put a
        floor of about 1e-5 under CG's relative residual, and whole-matrix widening would
        double the memory of a large model's factors.
        """
        v = v.to(torch.float64)
        total = self.diagonal * v
        for rows in torch.split(self.factors, _ROW_BLOCK):
            rows = rows.to(torch.float64)
            total += rows.T @ (rows @ v)
        return total

    def precision_diagonal(self) -> torch.Tensor:
        """diag(s(UᵀU + D)), in float64."""
        return _squared_column_sums(self.factors) + self.diagonal


def _squared_column_sums(factors: torch.Tensor) -> torch.Tensor:
    """diag(UᵀU) in float64, with bounded temporaries for large models."""
    total = torch.zeros(factors.shape[-1], dtype=torch.float64)
    for rows in torch.split(factors, _ROW_BLOCK):
        total += (rows.to(torch.float64) ** 2).sum(0)
    return total


def client_precisions(x: ModelInputs, *, by_size: bool) -> list[ClientPrecision]:
    """Each client's data precision from its diagonal Fisher and optional factors."""
    if by_size and x.sizes is None:
        raise MergeflowError("by_size needs the clients' data sizes (weights=...)")
    dim = sum(x.states[0][n].numel() for n in x.names)
    out = []
    for k, state in enumerate(x.states):
        scale = float(x.sizes[k]) if by_size else 1.0
        diagonal = x.flatten(x.fishers[k]) if x.fishers is not None else torch.zeros(dim, dtype=torch.float64)
        factors = x.factors[k] if x.factors is not None else torch.zeros((0, dim), dtype=torch.float64)
        if factors.shape[-1] != dim:
            raise MergeflowError(f"client {k} factors have {factors.shape[-1]} columns, the model has {dim} parameters")
        residual = (diagonal - _squared_column_sums(factors)).clamp_min(0)
        out.append(ClientPrecision(x.flatten(state), factors * scale**0.5, residual * scale))
    return out


PriorMean = Literal["auto", "base", "zero"]


def prior_mean(x: ModelInputs, choice: str) -> torch.Tensor:
    """θ₀, the mean of the prior every client's posterior holds: the shared base model (``base``, or
    ``auto`` when one is given) or zero, flattened."""
    if choice == "base" and x.base is None:
        raise MergeflowError("prior_mean 'base' needs the base model (base=...)")
    if choice == "base" or (choice == "auto" and x.base is not None):
        return x.flatten(x.base)
    return torch.zeros(sum(x.states[0][n].numel() for n in x.names), dtype=torch.float64)
