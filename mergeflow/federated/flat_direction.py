"""IVON-ADMM on a parameter that no data touches: the outer loop's stability in closed form.

A coordinate whose loss gradient and Hessian are zero has the prior as its exact posterior, yet
IVON-ADMM can carry its server mean away. For that coordinate every IVON step is deterministic
(the Price Hessian estimate avg(ε·ĝ) and the momentum stay exactly 0, whatever the weight noise),
so a whole run reduces to a scalar recursion per client, written out here step by step with the
same arithmetic as :class:`~mergeflow.federated.ivon_prior.IVONWithPrior` and
:class:`~mergeflow.federated.bayes_admm.BayesADMM` (ess E_k = N_k/(τρ), wd = S̄/E_k, h from 0
after round 0):

- client k, T_k steps: f = −V_k/(N_k/τ); h ← β2 h + (1 − β2) f + ½(1 − β2)²(h − f)²/(h + wd);
  m ← m − lr·(v_k/(N_k/τ) − V_k m/(N_k/τ) + wd (m − m̄))/(h + wd);
- message S_k = E_k (h + wd), m_k = m; duals v_k += dρ(S_k m_k − S̄m̄), V_k += dρ(S_k − S̄);
- server: α = 1/(1 + Kρ), S̄ ← (1 − α) mean S_k + α(δ + ΣV_k), S̄m̄ ← (1 − α) mean S_k m_k + α(δ m0 + Σv_k).

The mechanism. Round 0 starts IVON at h = ``hess_init``: every client reports about E_k·h of
precision no data supports, and V_k jumps to about d·N_k/τ·h. From then on h restarts at 0 and
covers only 1 − β2^T of the way to its target −V_k/(N_k/τ) in a round, so V_k decays by about
d(1 − β2^T) a round: hundreds of rounds. Meanwhile the client's local objective in that
coordinate has curvature (ρS̄ − V_k)/(N_k/τ), close to zero or negative, so the client's mean
moves far while the precision it reports stays near S̄: its message overstates its pull. The
dual and server steps amplify that offset by more than 1 a round when Kρ is small (Kρ sets the
server's weight α = 1/(1 + Kρ) on the prior and the dual sums); the amplification ends only when
V_k has decayed.
:func:`flat_offsets` runs the recursion; :func:`max_flat_growth` is its largest growth of
|m̄ − m0| over the first-round offset, which the tests and ``bench/flat_direction.py`` use to map
the stable region (docs/results.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from mergeflow.schema.federated import BayesADMMOptions


def local_steps(sizes: Sequence[int], epochs: int, batch_size: int) -> list[int]:
    """IVON steps per round of each client: ⌈N_k / batch⌉ mini-batches per epoch."""
    return [epochs * -(-n // batch_size) for n in sizes]


def flat_offsets(
    sizes: Sequence[int], steps: Sequence[int], options: BayesADMMOptions, rounds: int, offset: float = 1.0
) -> list[float]:
    """Server mean minus prior mean, m̄_r − m0, for r = 0..rounds, of a coordinate no loss touches.

    Args:
        sizes: N_k of every client (all take part in every round).
        steps: IVON steps each client takes per round (:func:`local_steps`).
        options: the algorithm's options (``server_step`` overrides α as in the algorithm).
        rounds: number of rounds.
        offset: m̄_0 − m0 (e.g. an initial weight of 1 under a zero prior mean).
    """
    n = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(steps)
    tau, rho, d, delta = options.temperature, options.rho, options.damping, options.prior_precision
    alpha = options.server_step if options.server_step is not None else 1.0 / (1.0 + len(n) * rho)
    b2, lr = options.beta2, options.lr
    scale = n / tau
    ess = scale / rho
    m_bar, s_bar = float(offset), float(delta)
    v, V = np.zeros_like(n), np.zeros_like(n)
    out = [m_bar]
    with np.errstate(all="ignore"):  # a run-away recursion overflows to inf/nan, which the caller reads
        for r in range(rounds):
            wd = s_bar / ess
            h = np.full_like(n, options.hess_init if r == 0 else 0.0)
            m = np.full_like(n, m_bar)
            target = -V / scale
            for step in range(int(t.max())):
                active = step < t
                h_new = b2 * h + (1 - b2) * target + 0.5 * (1 - b2) ** 2 * (h - target) ** 2 / (h + wd)
                m_new = m - lr * (v / scale - V * m / scale + wd * (m - m_bar)) / (h_new + wd)
                h, m = np.where(active, h_new, h), np.where(active, m_new, m)
            s_k = ess * (h + wd)
            eta_k = s_k * m
            v = v + d * rho * (eta_k - s_bar * m_bar)
            V = V + d * rho * (s_k - s_bar)
            s_bar = (1 - alpha) * s_k.mean() + alpha * (delta + V.sum())
            m_bar = ((1 - alpha) * eta_k.mean() + alpha * v.sum()) / s_bar  # the prior mean m0 is 0 here
            out.append(float(m_bar))
    return out


def max_flat_growth(sizes: Sequence[int], steps: Sequence[int], options: BayesADMMOptions, rounds: int) -> float:
    """max_r |m̄_r − m0| / |m̄_0 − m0| of :func:`flat_offsets` (inf once it overflows): ≤ 1 is stable."""
    offsets = np.abs(np.asarray(flat_offsets(sizes, steps, options, rounds)))
    return float(offsets.max()) if np.isfinite(offsets).all() else math.inf


def min_stable_rho(sizes: Sequence[int], steps: Sequence[int], options: BayesADMMOptions, rounds: int) -> float:
    """The smallest ρ ≥ ``options.rho`` (to 2%) at which :func:`max_flat_growth` stays at 1 over
    ``rounds``, the other options as given; ``math.inf`` if none up to 10⁴ does."""

    def stable(rho: float) -> bool:
        return max_flat_growth(sizes, steps, options.model_copy(update={"rho": rho}), rounds) <= 1.0 + 1e-9

    low = high = options.rho
    if stable(low):
        return low
    while not stable(high):
        low, high = high, high * 2.0
        if high > 1e4:
            return math.inf
    while high / low > 1.02:
        middle = math.sqrt(low * high)
        low, high = (low, middle) if stable(middle) else (middle, high)
    return high
