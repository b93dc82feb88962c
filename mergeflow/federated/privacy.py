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

import torch

from mergeflow.accounting import Mechanism
from mergeflow.federated.base import MEAN, Message, flat, unflat
from mergeflow.schema.federated import DPOptions
from mergeflow.seeding import derive_seed

CLIP_KEY = "dp.clip"


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
    draw = torch.randn(anchor.shape, generator=generator, dtype=torch.float64, device=generator.device)
    draw = draw.to(anchor.device, anchor.dtype)
    aggregate = anchor + (total + noise.sum_noise * clip * draw) / expected_clients
    new_clip = clip
    if options.adaptive:
        count_draw = float(torch.randn(1, generator=generator, dtype=torch.float64, device=generator.device))
        fraction_unclipped = (unclipped + noise.count_noise * count_draw) / expected_clients
        new_clip = clip * math.exp(-options.clip_lr * (fraction_unclipped - options.target_quantile))
    metrics = {"clip": clip, "unclipped": float(unclipped)}
    return unflat(aggregate, server_mean), new_clip, metrics
