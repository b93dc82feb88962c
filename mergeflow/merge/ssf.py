"""Self-supervised Fisher (SSF) merging: fit θ to every client's masked conditionals (SSF Eq. 7).

Each step draws fresh random masks. For a mask M (a fraction of a window of coordinates, the
rest of the window R conditioned on) and client k with precision Λ_k, the masked
coordinates get their Gaussian conditional given the rest:

    θ_M | θ_R ~ N(θ_k,M − Λ_MM⁻¹ Λ_MR (θ_R − θ_k,R),  Λ_MM⁻¹).

The loss is the negative sum of these log-densities over clients and masks, with the prior
correction (K−1)/K · log p0 per client (the prior is counted once in a product of
posteriors), optimised by SGD. Λ_k = n_k(U_kᵀU_k + D_k) + δI is low-rank plus diagonal,
so Λ_MM⁻¹ comes from the Woodbury identity with an r × r solve and Λ_MR never forms; the
reference code's rank-1 mean-gradient precision is the r = 1 case. With the full mask the
objective is the exact merge's, so its optimum is the product of the Gaussians.

Where the correction goes (``prior_correction``): ``per_client`` (the default) takes it out of each
client's Gaussian before conditioning, p(θ|D_k) · p0(θ)^−(K−1)/K = N(μ'_k, Λ'_k⁻¹) with
Λ'_k = Λ_k − (K−1)/K·δI, so every term is a proper conditional and the loss is bounded below.
``as_printed`` subtracts the prior's conditional after conditioning, as Eq. 7 is printed; with partial
masks and coupled precisions that loss is unbounded below from K = 3 (bench/ssf_horizon.py), since each
conditional is flat along directions that move masked and conditioning coordinates together while the
subtracted prior is not. Both are the exact merge's objective at the full mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mergeflow import cancel
from mergeflow.merge.engine import MergeResult, ModelInputs
from mergeflow.merge.precision import ClientPrecision, client_precisions, prior_mean
from mergeflow.schema.merge import SSFOptions


def _mask_sizes(dim: int, options: SSFOptions) -> tuple[int, int]:
    """(w, m): the coordinates a mask looks at, and how many of them it masks."""
    window = min(options.window or dim, dim)
    return window, max(1, round(options.mask_rate * window))


def _masks(
    dim: int, options: SSFOptions, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(J, m) masked and (J, w − m) conditioning coordinates, fresh for every step, on ``device`` (drawn on
    the CPU, so a seed draws the same masks on every device)."""
    window, masked = _mask_sizes(dim, options)
    steps = range(options.masks_per_step)
    draws = [torch.randperm(dim, generator=generator, device=generator.device)[:window] for _ in steps]
    order = torch.stack(draws).to(device)
    return order[:, :masked], order[:, masked:]


@dataclass(frozen=True)
class _LowRankSystem:
    """One client's Λ_MM for a batch of J masks, factored once per step (it does not depend on θ).

    Λ_MM = A + U_MᵀU_M with A diagonal. With fewer masked coordinates m than factor rows r
    it is factored directly (m × m); otherwise through Woodbury's r × r capacitance.
    """

    diagonal: torch.Tensor  # (J, m): s·D + δ on the masked coordinates
    u_masked: torch.Tensor  # (J, r, m)
    u_rest: torch.Tensor  # (J, r, w − m)
    cholesky: torch.Tensor  # (J, m, m) chol(Λ_MM) when direct, else (J, r, r) chol(I + U_M A⁻¹ U_Mᵀ)
    direct: bool

    def rhs(self, d_masked: torch.Tensor, d_rest: torch.Tensor) -> torch.Tensor:
        """Λ_MM Δ_M + Λ_MR Δ_R for (J, m) and (J, w − m) differences θ − θ_k."""
        projected = self.u_masked @ d_masked[..., None] + self.u_rest @ d_rest[..., None]  # (J, r, 1)
        return self.diagonal * d_masked + (self.u_masked.transpose(1, 2) @ projected)[..., 0]

    def solve(self, b: torch.Tensor) -> torch.Tensor:
        """Λ_MM⁻¹ b for a (J, m) right-hand side."""
        if self.direct:
            return torch.cholesky_solve(b[..., None], self.cholesky)[..., 0]
        # Woodbury: (A + UᵀU)⁻¹ b = A⁻¹b − A⁻¹Uᵀ (I + U A⁻¹ Uᵀ)⁻¹ U A⁻¹ b
        a_inv_b = b / self.diagonal
        inner = torch.cholesky_solve(self.u_masked @ a_inv_b[..., None], self.cholesky)
        return a_inv_b - (self.u_masked.transpose(1, 2) @ inner)[..., 0] / self.diagonal


@dataclass(frozen=True)
class _DenseSystem:
    """Λ_MM and Λ_MR gathered from a Λ formed once: for small models, where m × m blocks are
    factored anyway, indexing replaces the (J, m, r) × (J, r, m) product of every step."""

    lam_masked: torch.Tensor  # (J, m, m)
    lam_rest: torch.Tensor  # (J, m, w − m)
    cholesky: torch.Tensor  # (J, m, m)

    def rhs(self, d_masked: torch.Tensor, d_rest: torch.Tensor) -> torch.Tensor:
        """Λ_MM Δ_M + Λ_MR Δ_R for (J, m) and (J, w − m) differences θ − θ_k."""
        return (self.lam_masked @ d_masked[..., None] + self.lam_rest @ d_rest[..., None])[..., 0]

    def solve(self, b: torch.Tensor) -> torch.Tensor:
        """Λ_MM⁻¹ b for a (J, m) right-hand side."""
        return torch.cholesky_solve(b[..., None], self.cholesky)[..., 0]


_MaskedSystem = _LowRankSystem | _DenseSystem

# Λ_k is formed once when all clients' D × D float64 matrices fit in this many bytes.
_DENSE_MAX_BYTES = 512 << 20


def _wide_factors(client: ClientPrecision, columns: torch.Tensor | None = None) -> torch.Tensor:
    """√s · U (its ``columns`` only, when given) in float64: widened and scaled as it is used, never as a
    float64 copy of all the factors (five clients of a 22.7M-parameter model: 14.5 GB)."""
    factors = client.factors if columns is None else client.factors[:, columns]
    return factors.to(torch.float64) * client.factor_scale**0.5


def _dense_precision(client: ClientPrecision, delta: float) -> torch.Tensor:
    """Λ_k = s·UᵀU + diag(D) + δI as a D × D float64 matrix."""
    factors = _wide_factors(client)
    dense = factors.T @ factors
    dense.diagonal().add_(client.diagonal + delta)
    return dense


def _masked_system(
    client: ClientPrecision, delta: float, masked: torch.Tensor, rest: torch.Tensor, dense: torch.Tensor | None = None
) -> _MaskedSystem:
    """Client k's conditional system for this step's masks; ``dense`` is its formed Λ_k, if any."""
    if dense is not None:
        lam_masked = dense[masked[:, :, None], masked[:, None, :]]
        return _DenseSystem(lam_masked, dense[masked[:, :, None], rest[:, None, :]], torch.linalg.cholesky(lam_masked))
    diagonal = client.diagonal[masked] + delta
    u_masked = _wide_factors(client, masked).permute(1, 0, 2)
    u_rest = _wide_factors(client, rest).permute(1, 0, 2)
    direct = u_masked.shape[1] >= masked.shape[1]
    if direct:
        matrix = u_masked.transpose(1, 2) @ u_masked
        matrix.diagonal(dim1=1, dim2=2).add_(diagonal)
    else:
        scaled = u_masked * diagonal.rsqrt()[:, None, :]
        matrix = scaled @ scaled.transpose(1, 2)
        matrix.diagonal(dim1=1, dim2=2).add_(1.0)
    return _LowRankSystem(diagonal, u_masked, u_rest, torch.linalg.cholesky(matrix), direct)


def _compressed(client: ClientPrecision) -> ClientPrecision:
    """The same precision with at most D factor rows: s·UᵀU = RᵀR for the QR factor R of √s·U."""
    rows, dim = client.factors.shape
    if rows <= dim:
        return client
    r = torch.linalg.qr(_wide_factors(client), mode="r").R
    return ClientPrecision(client.theta, r, client.diagonal)


def _conditional_quadratic(
    diff: torch.Tensor,
    system: _MaskedSystem,
    masked: torch.Tensor,
    rest: torch.Tensor,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ over masks of (θ_M − μ)ᵀ Λ_MM (θ_M − μ) = bᵀ Λ_MM⁻¹ b, with b = Λ_MM Δ_M + Λ_MR Δ_R (+ ``shift``_M,
    which moves the Gaussian's mean: Λ(θ − μ') = Λ(θ − θ_k) + shift)."""
    b = system.rhs(diff[masked], diff[rest])
    if shift is not None:
        b = b + shift[masked]
    return (b * system.solve(b)).sum()


def _tempered_prior(
    clients: list[ClientPrecision], delta: float, theta0: torch.Tensor, options: SSFOptions
) -> tuple[float, list[torch.Tensor | None], float]:
    """(the prior precision inside each client's Gaussian, each client's mean shift, the weight of the prior
    subtracted after conditioning) for the chosen ``prior_correction``.

    ``per_client``: N(θ_k, Λ_k⁻¹) · p0^−c with c = (K−1)/K has precision Λ'_k = Λ_k − cδI and
    Λ'_k μ'_k = Λ_k θ_k − cδθ0, so Λ'_k(θ − μ'_k) = Λ'_k(θ − θ_k) + cδ(θ0 − θ_k): no solve for μ'_k.
    """
    count = len(clients)
    if options.prior_correction == "as_printed" or count == 1:
        return delta, [None] * count, (count - 1) * delta
    correction = (count - 1) / count * delta
    return delta - correction, [correction * (theta0 - c.theta) for c in clients], 0.0


def ssf_iterates(x: ModelInputs, options: SSFOptions) -> Iterator[tuple[torch.Tensor, float]]:
    """Yield (θ after the step, the step's loss) for every optimisation step of Eq. 7.

    The merge method keeps the last θ; experiments can watch θ converge step by step.
    """
    clients = [_compressed(c) for c in client_precisions(x, by_size=options.by_size)]
    delta = options.prior_precision
    theta0 = prior_mean(x, options.prior_mean)  # as in the exact merge
    generator = torch.Generator().manual_seed(options.seed)
    average = sum(w * c.theta for w, c in zip(x.weights, clients, strict=True))
    if options.start == "average":
        start = average.clone()
    else:
        start = torch.randn(average.shape, generator=generator, dtype=average.dtype, device=generator.device)
        start = start.to(average.device) * average.std()
    theta = start.requires_grad_(True)
    optimizer = (
        torch.optim.SGD([theta], lr=options.lr, momentum=options.momentum)
        if options.optimizer == "sgd"
        else torch.optim.Adam([theta], lr=options.lr)
    )
    scheduler = (
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=options.steps)
        if options.schedule == "cosine"
        else None
    )
    count, dim = len(clients), theta.numel()
    masked_count = _mask_sizes(dim, options)[1]
    client_delta, shifts, subtracted = _tempered_prior(clients, delta, theta0, options)
    # Formed only for clients whose Λ_MM would be factored directly (m ≤ rows) anyway.
    small = count * dim * dim * 8 <= _DENSE_MAX_BYTES
    dense = [
        _dense_precision(c, client_delta) if small and c.factors.shape[0] >= masked_count else None for c in clients
    ]
    for _ in range(options.steps):
        cancel.check()
        masked, rest = _masks(dim, options, generator, theta.device)
        systems = [_masked_system(c, client_delta, masked, rest, d) for c, d in zip(clients, dense, strict=True)]
        optimizer.zero_grad()
        quadratic = sum(
            _conditional_quadratic(theta - c.theta, s, masked, rest, shift)
            for c, s, shift in zip(clients, systems, shifts, strict=True)
        )
        prior = subtracted * ((theta[masked] - theta0[masked]) ** 2).sum()
        loss = 0.5 * (quadratic - prior) / masked.numel()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        yield theta.detach().clone(), float(loss.detach())


def ssf(x: ModelInputs, options: SSFOptions) -> MergeResult:
    """Self-supervised Fisher merging: SGD on the clients' masked Gaussian conditionals."""
    losses: list[float] = []
    for step in ssf_iterates(x, options):  # keeps only the latest θ in memory
        losses.append(step[1])
    return MergeResult(x.unflatten(step[0]), {"ssf_loss": losses}, {"ssf_final_loss": losses[-1]})
