"""Server optimizers on the pseudo-gradient (Reddi et al. 2021, "Adaptive Federated Optimization").

The aggregate of a round θ̄_agg (what plain averaging would make the global model) gives the
pseudo-gradient Δ = θ̄_agg − θ̄, which a server optimizer with its own state turns into the step.
The state lives in the server state under ``server_m.<param>`` and ``server_v.<param>`` (created at
the first step), so it is stored and resumed with the rest of the server.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mergeflow.federated.base import MEAN, ServerState
from mergeflow.schema.federated import ServerOptimizerOptions

SERVER_M = "server_m."
SERVER_V = "server_v."


def second_moment(v: torch.Tensor, delta: torch.Tensor, options: ServerOptimizerOptions) -> torch.Tensor:
    """v_t from v_{t−1} and Δ_t: Adagrad v + Δ², Adam β2 v + (1−β2)Δ², Yogi v − (1−β2)Δ² sign(v − Δ²)."""
    square = delta * delta
    if options.optimizer == "adagrad":
        return v + square
    if options.optimizer == "adam":
        return options.beta2 * v + (1.0 - options.beta2) * square
    return v - (1.0 - options.beta2) * square * torch.sign(v - square)


def step_size(options: ServerOptimizerOptions, round_number: int) -> float:
    """η, times √(1−β2ᵗ)/(1−β1ᵗ) with ``bias_correction`` (t = ``round_number``, from 1)."""
    if not options.bias_correction:
        return options.lr
    t = float(round_number)
    return options.lr * (1.0 - options.beta2**t) ** 0.5 / (1.0 - options.beta1**t)


def server_optimizer_step(
    server: ServerState,
    aggregate: Mapping[str, torch.Tensor],
    options: ServerOptimizerOptions,
    round_number: int,
) -> ServerState:
    """The server state after one optimizer step towards ``aggregate`` (parameter name → θ̄_agg).

    ``server`` holds θ̄ under ``mean.<param>`` and the optimizer's moments; keys other than these
    are kept. ``sgd`` with lr 1 returns θ̄ = θ̄_agg exactly.
    """
    new = dict(server)
    eta = step_size(options, round_number)
    for name, target in aggregate.items():
        theta = server[MEAN + name]
        delta = target.to(theta.dtype) - theta
        if options.optimizer == "sgd":
            new[MEAN + name] = target.to(theta.dtype) if options.lr == 1.0 else theta + options.lr * delta
            continue
        m = server.get(SERVER_M + name, torch.zeros_like(theta))
        if options.optimizer == "avgm":
            m = options.momentum * m + delta
            new[SERVER_M + name], new[MEAN + name] = m, theta + options.lr * m
            continue
        v0 = options.tau**2 if options.initial_v is None else options.initial_v
        v = server.get(SERVER_V + name, torch.full_like(theta, v0))
        m = options.beta1 * m + (1.0 - options.beta1) * delta
        v = second_moment(v, delta, options)
        new[SERVER_M + name], new[SERVER_V + name] = m, v
        new[MEAN + name] = theta + eta * m / (v.sqrt() + options.tau)
    return new
