"""FedProx (Li et al. 2020): FedAvg plus the local proximal term μ/2·‖θ − θ_global‖².

The term is the *squared* norm, as in the paper (the Bayes-ADMM reference code and Flower's
example use the unsquared ``torch.norm``). It is added to the client's mean mini-batch loss, so
μ is on the scale of the per-example loss.
"""

from __future__ import annotations

import torch
from torch import nn

from mergeflow.federated.base import (
    MEAN,
    ClientState,
    Message,
    ServerState,
    exchanged_parameters,
    take_prefix,
)
from mergeflow.federated.fedavg import FedAvg
from mergeflow.federated.quadratic_loss import THETA, QuadraticProblem, eye_like, psolve
from mergeflow.schema.federated import FedProxOptions


class FedProx(FedAvg):
    """FedProx: FedAvg with the local proximal term μ/2·‖θ − θ̄‖² (squared norm)."""

    def penalty(self, model: nn.Module, server: ServerState, client: ClientState, n: int, options: FedProxOptions):
        """μ/2 Σ_p ‖p − θ̄_p‖² over all parameters."""
        if options.mu == 0.0:
            return None
        named = dict(exchanged_parameters(model))
        anchors = {name: t.to(named[name].dtype) for name, t in take_prefix(server, MEAN).items()}

        def proximal() -> torch.Tensor:
            return 0.5 * options.mu * sum(((named[k] - anchors[k]) ** 2).sum() for k in named)

        return proximal

    def exact_client_update(
        self, server: ServerState, client: ClientState, problem: QuadraticProblem, options: FedProxOptions
    ) -> tuple[Message, ClientState, dict[str, float]]:
        """θ_k = argmin ℓ_k/n_k + μ/2‖θ − θ̄‖² = (H_k/n_k + μI)⁻¹(b_k/n_k + μθ̄)."""
        anchor = server[MEAN + THETA]
        n = float(problem.n)
        theta = psolve(problem.H / n + options.mu * eye_like(problem.H, problem.b), problem.b / n + options.mu * anchor)
        return {MEAN + THETA: theta}, dict(client), {"loss": problem.loss(theta)}
