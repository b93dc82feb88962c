"""Client precisions Λ_k = s_k (U_kᵀU_k + D_k) + δI over the flattened model, never formed.

U_k are per-client Fisher factors (F ≈ UᵀU, averaged over examples), D_k the rest of the
diagonal Fisher not explained by U_k, s_k the client's data size and δ the prior
precision (counted once in a product of posteriors). Shared by the exact and SSF merges.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mergeflow.errors import MergeflowError
from mergeflow.merge.engine import ModelInputs

# Factor rows widened to float64 at once: bounds the temporaries for large models.
_ROW_BLOCK = 64


class _Scratch:
    """One float64 buffer for widening factor blocks, reused by every product of a merge: a fresh
    buffer per block made the allocator map and unmap it each time (60% system time at 1M parameters)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def widened(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` in float64 (the tensor itself when it already is), in the reused buffer."""
        if rows.dtype == torch.float64:
            return rows
        if self._buffer is None or self._buffer.numel() < rows.numel():
            self._buffer = torch.empty(rows.numel(), dtype=torch.float64, device=rows.device)
        return self._buffer[: rows.numel()].view(rows.shape).copy_(rows)


@dataclass(frozen=True)
class ClientPrecision:
    """The data part s(UᵀU + D) of one client's precision, plus its mean θ_k.

    The factors are the caller's (float32 or float64, not copied): the low-rank part is
    ``factor_scale · UᵀU``; the diagonal is already scaled by s.
    """

    theta: torch.Tensor
    factors: torch.Tensor  # (rows, D)
    diagonal: torch.Tensor  # (D,), float64
    factor_scale: float = 1.0
    scratch: _Scratch = field(default_factory=_Scratch, compare=False, repr=False)

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """(s(UᵀU + D)) v in float64 without forming a D × D matrix.

        Float32 factors are widened a block of rows at a time into a reused buffer: products in
        float32 put a floor of about 1e-5 under CG's relative residual, and whole-matrix widening
        would double the memory of a large model's factors.
        """
        v = v.to(torch.float64)
        total = self.diagonal * v
        for rows in torch.split(self.factors, _ROW_BLOCK):
            wide = self.scratch.widened(rows)
            total.addmv_(wide.T, wide @ v, alpha=self.factor_scale)
        return total

    def project(self, v: torch.Tensor) -> torch.Tensor:
        """√s · U v in float64 (one length-``rows`` vector), widening a block of rows at a time."""
        out = torch.empty(len(self.factors), dtype=torch.float64, device=v.device)
        for start in range(0, len(self.factors), _ROW_BLOCK):
            rows = self.factors[start : start + _ROW_BLOCK]
            torch.mv(self.scratch.widened(rows), v, out=out[start : start + len(rows)])
        return out.mul_(self.factor_scale**0.5)

    def lift(self, weights: torch.Tensor, into: torch.Tensor) -> None:
        """``into`` += √s · Uᵀ weights, in float64, widening a block of rows at a time."""
        for start in range(0, len(self.factors), _ROW_BLOCK):
            rows = self.factors[start : start + _ROW_BLOCK]
            block = weights[start : start + len(rows)]
            into.addmv_(self.scratch.widened(rows).T, block, alpha=self.factor_scale**0.5)

    def precision_diagonal(self) -> torch.Tensor:
        """diag(s(UᵀU + D)), in float64."""
        return self.factor_scale * _squared_column_sums(self.factors, self.scratch) + self.diagonal


def _squared_column_sums(factors: torch.Tensor, scratch: _Scratch | None = None) -> torch.Tensor:
    """diag(UᵀU) in float64, squaring a block of rows at a time in a reused float64 buffer."""
    scratch = scratch or _Scratch()
    total = torch.zeros(factors.shape[-1], dtype=torch.float64, device=factors.device)
    for rows in torch.split(factors, _ROW_BLOCK):
        wide = scratch.widened(rows)
        if wide is rows:  # float64 factors are the caller's: square a copy
            wide = rows.square()
        else:
            wide.square_()
        total += wide.sum(0)
    return total


def client_precisions(x: ModelInputs, *, by_size: bool) -> list[ClientPrecision]:
    """Each client's data precision from its diagonal Fisher and optional factors (not copied); the
    clients share one scratch buffer, so use their products one at a time."""
    if by_size and x.sizes is None:
        raise MergeflowError("by_size needs the clients' data sizes (weights=...)")
    dim = sum(x.states[0][n].numel() for n in x.names)
    device = x.weights.device
    scratch = _Scratch()
    out = []
    for k, state in enumerate(x.states):
        scale = float(x.sizes[k]) if by_size else 1.0
        none = torch.zeros((0, dim), dtype=torch.float64, device=device)
        diagonal = x.flatten(x.fishers[k]) if x.fishers is not None else none.new_zeros(dim)
        factors = x.factors[k] if x.factors is not None else none
        if factors.shape[-1] != dim:
            raise MergeflowError(f"client {k} factors have {factors.shape[-1]} columns, the model has {dim} parameters")
        residual = (diagonal - _squared_column_sums(factors, scratch)).clamp_min(0)
        out.append(ClientPrecision(x.flatten(state), factors, residual * scale, scale, scratch))
    return out


def prior_mean(x: ModelInputs, choice: str) -> torch.Tensor:
    """θ₀, the mean of the prior every client's posterior holds: the shared base model (``base``, or
    ``auto`` when one is given) or zero, flattened."""
    if choice == "base" and x.base is None:
        raise MergeflowError("prior_mean 'base' needs the base model (base=...)")
    if choice == "base" or (choice == "auto" and x.base is not None):
        return x.flatten(x.base)
    return torch.zeros(sum(x.states[0][n].numel() for n in x.names), dtype=torch.float64, device=x.weights.device)
