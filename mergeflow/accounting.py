"""The privacy accounting of DP-FedAvg: Opacus' RDP accountant for the Poisson-sampled Gaussian mechanism,
and the noise a run needs. Torch-free here (Opacus is imported only when asked), so that validating
params can check a DP setting before any heavy work.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

from mergeflow.schema.federated import DPOptions


@functools.lru_cache(maxsize=64)
def _one_round_rdp(noise_multiplier: float, sample_rate: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Opacus' RDP orders and the sampled Gaussian mechanism's RDP at each, for one round (cached: a run
    asks for the same (σ, q) every round, and RDP composes by adding)."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp

    orders = tuple(RDPAccountant.DEFAULT_ALPHAS)
    rdp = compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(orders))
    return orders, tuple(float(x) for x in rdp)


def epsilon(noise_multiplier: float, sample_rate: float, rounds: int, delta: float) -> float:
    """ε of ``rounds`` compositions of the sampled Gaussian mechanism: what Opacus' ``RDPAccountant``
    gives after ``rounds`` steps of (σ, q), at δ."""
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0.0:
        return math.inf
    from opacus.accountants.analysis.rdp import get_privacy_spent

    orders, rdp = _one_round_rdp(float(noise_multiplier), float(sample_rate))
    with warnings.catch_warnings():  # "optimal order is the largest alpha": the bound is looser, still valid
        warnings.simplefilter("ignore", UserWarning)
        eps, _ = get_privacy_spent(orders=list(orders), rdp=[rounds * x for x in rdp], delta=delta)
    return float(eps)


def smallest_epsilon(delta: float) -> float:
    """The ε the accountant reports as σ → ∞ (every order's RDP → 0): no noise reaches a smaller target."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import get_privacy_spent

    orders = list(RDPAccountant.DEFAULT_ALPHAS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return float(get_privacy_spent(orders=orders, rdp=[0.0] * len(orders), delta=delta)[0])


@functools.lru_cache(maxsize=16)
def noise_for_target(target_epsilon: float, delta: float, sample_rate: float, rounds: int) -> float:
    """The least noise multiplier whose ε after ``rounds`` is at most ``target_epsilon`` (within 0.01),
    by Opacus' own search.

    Raises:
        ValueError: when no noise reaches it (at or below :func:`smallest_epsilon`, or Opacus' "The
            privacy budget is too low").
    """
    from opacus.accountants.utils import get_noise_multiplier

    if target_epsilon <= smallest_epsilon(delta) + 0.01:
        raise ValueError("The privacy budget is too low.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return float(
            get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=rounds,
                accountant="rdp",
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
