"""The exactly solvable client path: rounds over quadratic (linear-Gaussian) client losses.

Client k has the summed loss ℓ_k(θ) = ½ θᵀH_kθ − b_kᵀθ (+ const) over its n_k examples
(:class:`~mergeflow.federated.quadratic_loss.QuadraticProblem`). Every algorithm has a closed-form client step
(:meth:`~mergeflow.federated.base.FederatedAlgorithm.exact_client_update`) that solves exactly the
local problem its neural client solves approximately (same scaling of the loss), and the rounds
reuse the algorithms' own ``server_update``, so the server rules are checked exactly.

Examples: the slides' toy, clients {1,2,3} and {4,6,5,5,10} with ℓ = ½Σ(θ − x)², is
``[scalar_problem([1, 2, 3]), scalar_problem([4, 6, 5, 5, 10])]``; a linear-Gaussian model
y = Xθ + N(0, σ²) gives ``linear_gaussian_problem(X, y, σ)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel

from mergeflow.federated.base import (
    MEAN,
    ClientState,
    FederatedAlgorithm,
    ServerState,
    get_algorithm,
)
from mergeflow.federated.quadratic_loss import (
    THETA,
    QuadraticProblem,
    as_full,
    psolve,
)
from mergeflow.federated.rounds import round_schedule

# Keys whose tensors are precisions (diagonal vectors or full matrices).
PRECISION_PREFIXES = ("precision.", "dual_prec.", "dual_prec_sum.")


def exact_posterior(
    problems: Sequence[QuadraticProblem],
    prior_precision: float,
    prior_mean: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and precision of the full-data (tempered) posterior ∝ N(m0, δ⁻¹I)·Π exp(−ℓ_k/τ).

    The precision is a matrix when any H_k is one, else a diagonal vector.
    """
    full = any(p.H.dim() == 2 for p in problems)
    dim = problems[0].dim
    m0 = torch.zeros(dim, dtype=torch.float64) if prior_mean is None else torch.as_tensor(prior_mean).double()
    identity = torch.eye(dim, dtype=torch.float64) if full else torch.ones(dim, dtype=torch.float64)
    precision = prior_precision * identity
    eta = prior_precision * m0
    for p in problems:
        precision = precision + (as_full(p.H) if full else p.H) / temperature
        eta = eta + p.b / temperature
    return psolve(precision, eta), precision


# ----------------------------------------------------------------------------- precision algebra


def full_covariance(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A server or client state with every diagonal precision (and precision dual) made a full matrix."""
    return {k: as_full(v) if k.startswith(PRECISION_PREFIXES) else v for k, v in state.items()}


# ----------------------------------------------------------------------------- rounds


@dataclass
class QuadraticRun:
    """Server states before round 0 and after every round, and the final client states."""

    servers: list[ServerState] = field(default_factory=list)
    clients: dict[int, ClientState] = field(default_factory=dict)

    def means(self) -> list[torch.Tensor]:
        """The global θ̄ after each round (index 0: the initial one)."""
        return [s[MEAN + THETA] for s in self.servers]


def run_quadratic_rounds(
    algorithm: str | FederatedAlgorithm,
    problems: Sequence[QuadraticProblem],
    rounds: int,
    options: BaseModel | Mapping[str, Any] | None = None,
    *,
    theta0: torch.Tensor | None = None,
    fraction: float = 1.0,
    seed: int = 0,
    full: bool | None = None,
) -> QuadraticRun:
    """Run ``rounds`` rounds with the closed-form client steps and the algorithm's server update.

    Args:
        algorithm: a registered name or an algorithm instance.
        problems: one quadratic loss per client.
        rounds: number of rounds.
        options: the algorithm's options.
        theta0: the initial global parameters (zeros by default).
        fraction: fraction of clients per round (:func:`~mergeflow.federated.rounds.round_schedule`).
        seed: seed of the participant sampling.
        full: keep full precision matrices (default: when any H_k is a matrix).
    """
    algo = get_algorithm(algorithm)
    opts = algo.parse_options(options)
    dim = problems[0].dim
    theta = torch.zeros(dim, dtype=torch.float64) if theta0 is None else torch.as_tensor(theta0).double().reshape(-1)
    full = any(p.H.dim() == 2 for p in problems) if full is None else full
    server = algo.init_server({THETA: theta}, len(problems), opts)
    clients = {k: algo.init_client({THETA: theta}, opts) for k in range(len(problems))}
    if full:
        server = full_covariance(server)
        clients = {k: full_covariance(c) for k, c in clients.items()}
    run = QuadraticRun(servers=[server], clients=clients)
    sizes = {k: p.n for k, p in enumerate(problems)}
    for step in round_schedule(len(problems), rounds, fraction, seed):
        messages = {}
        for k in step.participants:
            problem = problems[k]
            if full and problem.H.dim() == 1:
                problem = QuadraticProblem(as_full(problem.H), problem.b, problem.n)
            messages[k], clients[k], _ = algo.exact_client_update(server, clients[k], problem, opts)
        server = algo.server_update(server, messages, sizes, len(problems), opts)
        run.servers.append(server)
    run.clients = clients
    return run
