"""Server optimizers on the pseudo-gradient (Reddi et al. 2021, "Adaptive Federated Optimization"), the
implementations of those declared in ``mergeflow.schema.federated``
(:data:`~mergeflow.schema.federated.SERVER_OPTIMIZERS`).

The aggregate of a round θ̄_agg (what plain averaging would make the global model) gives the
pseudo-gradient Δ = θ̄_agg − θ̄, which a server optimizer with its own state turns into the step.
Each function here is that step on one parameter: the server state's new entries for it, from the
state, the aggregate ``target`` (in θ̄'s dtype) and the step size ``lr``
(:func:`mergeflow.federated.server_plan.server_optimizer_step` runs it over the parameters). The
moments live in the server state under ``server_m.<param>`` and ``server_v.<param>`` (created at the
first step), so they are stored and resumed with the rest of the server.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mergeflow.federated.base import MEAN, ServerState
from mergeflow.schema.federated import ServerOptimizerOptions

SERVER_M = "server_m."
SERVER_V = "server_v."

Entries = dict[str, torch.Tensor]


def sgd(server: ServerState, name: str, target: torch.Tensor, options: ServerOptimizerOptions, lr: float) -> Entries:
    """θ̄ += η Δ; with η = 1, θ̄ = the aggregate exactly."""
    theta = server[MEAN + name]
    return {MEAN + name: target if lr == 1.0 else theta + lr * (target - theta)}


def avgm(server: ServerState, name: str, target: torch.Tensor, options: ServerOptimizerOptions, lr: float) -> Entries:
    """FedAvgM: m = β m + Δ, θ̄ += η m."""
    theta = server[MEAN + name]
    m = options.momentum * server.get(SERVER_M + name, torch.zeros_like(theta)) + (target - theta)
    return {SERVER_M + name: m, MEAN + name: theta + lr * m}


def adagrad(
    server: ServerState, name: str, target: torch.Tensor, options: ServerOptimizerOptions, lr: float
) -> Entries:
    """FedAdagrad: v += Δ²."""
    return _adaptive(server, name, target, options, lr, lambda v, square: v + square)


def adam(server: ServerState, name: str, target: torch.Tensor, options: ServerOptimizerOptions, lr: float) -> Entries:
    """FedAdam: v = β2 v + (1−β2) Δ²."""
    beta2 = options.beta2
    return _adaptive(server, name, target, options, lr, lambda v, square: beta2 * v + (1.0 - beta2) * square)


def yogi(server: ServerState, name: str, target: torch.Tensor, options: ServerOptimizerOptions, lr: float) -> Entries:
    """FedYogi: v −= (1−β2) Δ² sign(v − Δ²)."""
    beta2 = options.beta2
    return _adaptive(
        server, name, target, options, lr, lambda v, square: v - (1.0 - beta2) * square * torch.sign(v - square)
    )


def _adaptive(
    server: ServerState,
    name: str,
    target: torch.Tensor,
    options: ServerOptimizerOptions,
    lr: float,
    second_moment: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Entries:
    """m = β1 m + (1−β1) Δ, v = ``second_moment(v, Δ²)``, θ̄ += η m / (√v + τ); m₋₁ = 0, v₋₁ = ``initial_v`` or τ²."""
    theta = server[MEAN + name]
    delta = target - theta
    m = server.get(SERVER_M + name, torch.zeros_like(theta))
    v0 = options.tau**2 if options.initial_v is None else options.initial_v
    v = server.get(SERVER_V + name, torch.full_like(theta, v0))
    m = options.beta1 * m + (1.0 - options.beta1) * delta
    v = second_moment(v, delta * delta)
    return {SERVER_M + name: m, SERVER_V + name: v, MEAN + name: theta + lr * m / (v.sqrt() + options.tau)}
