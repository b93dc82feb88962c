"""RegMean (Jin et al. 2023): each linear layer solved in closed form from the clients' input Grams."""

from __future__ import annotations

import torch

from mergeflow.grams import CONV1D
from mergeflow.merge.engine import MergeResult, ModelInputs
from mergeflow.schema.merge import RegMeanOptions

RCOND = 1e-6


def shrink(gram: torch.Tensor, alpha: float) -> torch.Tensor:
    """α·G + (1 − α)·diag(G)."""
    return alpha * gram + (1 - alpha) * torch.diag(torch.diagonal(gram))


def minimum_norm_solve(gram: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """The minimum-norm X of ``gram`` X = ``rhs`` for a symmetric PSD ``gram``, singular values below RCOND of the
    largest dropped: LAPACK's SVD least squares (``gelsd``) on the CPU; on a GPU, whose ``lstsq`` has no such
    driver, the same pseudo-inverse from the eigendecomposition (``pinv(hermitian=True)``)."""
    if gram.device.type == "cpu":
        return torch.linalg.lstsq(gram, rhs, rcond=RCOND, driver="gelsd").solution
    return torch.linalg.pinv(gram, rtol=RCOND, hermitian=True) @ rhs


def regmean(x: ModelInputs, options: RegMeanOptions) -> MergeResult:
    """RegMean: W* = Σ_k W_k G_k (Σ_k G_k)⁻¹ per linear layer (G_k = X_kᵀX_k; ``nn.Linear`` and GPT-2's
    ``Conv1D``), other parameters averaged."""
    assert x.grams is not None  # needed, per mergeflow.schema.merge
    state = {name: torch.stack([s[name].to(torch.float64) for s in x.states]).mean(dim=0) for name in x.names}
    for key in x.grams[0]:
        grams = [shrink(g[key], options.alpha) for g in x.grams]
        # Weights as (inputs, outputs): Wᵀ of nn.Linear, W itself of a Conv1D (GPT-2).
        name, transposed = key.removeprefix(CONV1D), not key.startswith(CONV1D)
        weights = [s[name].to(torch.float64) for s in x.states]
        weights = [w.T for w in weights] if transposed else weights
        # (Σ G_k) W = Σ G_k W_k. Input directions the clients almost never take (eigenvalues below
        # RCOND of the largest, e.g. digits' border pixels) get the minimum-norm W, not amplified noise.
        rhs = sum(g @ w for g, w in zip(grams, weights, strict=True))
        solution = minimum_norm_solve(sum(grams), rhs)
        state[name] = solution.T if transposed else solution
    return MergeResult(state, summary={"regmean_layers": float(len(x.grams[0]))})
