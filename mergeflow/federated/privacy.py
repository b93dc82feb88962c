"""Client-level differential privacy: DP-FedAvg (McMahan et al. 2018) with fixed or adaptive clipping
(Andrew et al. 2021), accounted by Opacus' RDP accountant for the Poisson-sampled Gaussian mechanism.

Each round samples every client independently with probability q (``federated.fraction``); a
participant's update Δ_k = θ_k − θ̄ (all exchanged parameters flattened together) is clipped to norm
C, and the server forms θ̄_agg = θ̄ + (Σ_k clip(Δ_k) + N(0, σ_Δ² C² I)) / (qK), the fixed
denominator qK of the paper's uniform-weight estimator. One client's data changes the sum by at most
C, so a round is the sampled Gaussian mechanism with noise multiplier σ (add/remove-one-client
adjacency), and T rounds are its T-fold composition.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mergeflow.federated.base import MEAN, Message, flat, unflat
from mergeflow.schema.federated import DPOptions
from mergeflow.seeding import derive_seed

CLIP_KEY = "dp.clip"


def epsilon(noise_multiplier: float, sample_rate: float, rounds: int, delta: float) -> float:
    """ε of ``rounds`` compositions of the sampled Gaussian mechanism (Opacus' RDP accountant)."""
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0.0:
        return math.inf
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(noise_multiplier, sample_rate, rounds)]
    return float(accountant.get_epsilon(delta=delta))


def noise_for_target(target_epsilon: float, delta: float, sample_rate: float, rounds: int) -> float:
    """The least noise multiplier whose ε after ``rounds`` is at most ``target_epsilon`` (within 0.01).

    Raises:
        ValueError: when no noise reaches it (Opacus: "The privacy budget is too low").
    """
    from opacus.accountants.utils import get_noise_multiplier

    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate, steps=rounds, accountant="rdp"
        )
    )


@dataclass(frozen=True)
class Mechanism:
    """The noise of a DP run: σ the mechanism's (what the accountant sees), σ_Δ the sum's, σ_b the count's."""

    noise_multiplier: float
    sum_noise: float
    count_noise: float | None


def mechanism(options: DPOptions, num_clients: int, fraction: float, rounds: int) -> Mechanism:
    """σ from ``noise_multiplier`` or ``target_epsilon``; with adaptive clipping, σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−½)
    (Andrew et al. 2021, Theorem 1), so that the sum and the clip count together spend what σ does.

    Raises:
        ValueError: one line naming the key, when the target is unreachable or σ ≥ 2σ_b.
    """
    sigma = options.noise_multiplier
    if sigma is None:
        try:
            sigma = noise_for_target(options.target_epsilon, options.delta, fraction, rounds)
        except ValueError:
            raise ValueError(
                f"federated.dp.target_epsilon: ε = {options.target_epsilon} at δ = {options.delta} is unreachable "
                f"in {rounds} rounds at sampling rate {fraction} (no noise multiplier reaches it)"
            ) from None
    if not options.adaptive:
        return Mechanism(sigma, sigma, None)
    count = options.count_noise_for(fraction * num_clients)
    if sigma == 0.0 or sigma >= 2.0 * count:
        key = "noise_multiplier" if options.noise_multiplier is not None else "target_epsilon"
        raise ValueError(
            f"federated.dp.{key}: adaptive clipping needs 0 < σ < 2·count_noise = {2 * count:g} (the clip count "
            f"alone spends σ = 2·count_noise); σ is {sigma:g}: raise count_noise or lower the privacy asked"
        )
    return Mechanism(sigma, (sigma**-2 - (2.0 * count) ** -2) ** -0.5, count)


def check_dp(options: DPOptions, num_clients: int, fraction: float, rounds: int) -> str | None:
    """Why these DP settings cannot run (one line naming the key), or None."""
    try:
        mechanism(options, num_clients, fraction, rounds)
    except ValueError as error:
        return str(error)
    return None


def clip_update(delta: torch.Tensor, clip: float) -> tuple[torch.Tensor, bool]:
    """Δ·min(1, C/‖Δ‖), and whether Δ was within the clip (‖Δ‖ ≤ C)."""
    norm = float(delta.norm())
    return (delta if norm <= clip else delta * (clip / norm)), norm <= clip


def private_average(
    server_mean: Mapping[str, torch.Tensor],
    messages: Mapping[int, Message],
    options: DPOptions,
    noise: Mechanism,
    clip: float,
    expected_clients: float,
    seed: int,
    round_number: int,
) -> tuple[dict[str, torch.Tensor], float, dict[str, float]]:
    """DP-FedAvg's aggregate θ̄ + (Σ clip(Δ_k) + N(0, σ_Δ²C²)) / (qK), the next round's clip, and metrics.

    The noise comes from a generator derived from (seed, "dp", round), drawn on the CPU in float64
    and moved to the parameters' device; it is added even when no client took part.
    """
    anchor = flat(server_mean)
    total = torch.zeros_like(anchor)
    unclipped = 0
    for k in sorted(messages):
        theta = flat({name: messages[k][MEAN + name] for name in server_mean}).to(anchor.dtype)
        clipped, within = clip_update(theta - anchor, clip)
        total += clipped
        unclipped += int(within)
    generator = torch.Generator().manual_seed(derive_seed(seed, "dp", round_number))
    draw = torch.randn(anchor.shape, generator=generator, dtype=torch.float64).to(anchor.device, anchor.dtype)
    aggregate = anchor + (total + noise.sum_noise * clip * draw) / expected_clients
    new_clip = clip
    if options.adaptive:
        count_draw = float(torch.randn(1, generator=generator, dtype=torch.float64))
        fraction_unclipped = (unclipped + noise.count_noise * count_draw) / expected_clients
        new_clip = clip * math.exp(-options.clip_lr * (fraction_unclipped - options.target_quantile))
    metrics = {"clip": clip, "unclipped": float(unclipped)}
    return unflat(aggregate, server_mean), new_clip, metrics
