"""FedADMM: consensus ADMM with per-client duals v_k (point estimates).

The problem is min Σ_k ℓ_k(θ_k) + δ/2‖θ̄‖² s.t. θ_k = θ̄, with ℓ_k the client's *summed* loss (so
that the fixed point is the full-data optimum, weighted by data size). One round (the variant of
the Bayes-ADMM notes, ``toyexamples/admm.py``):

1. client: θ_k = argmin ℓ_k(θ) + ⟨v_k, θ⟩ + ρ/2‖θ − θ̄‖², started from θ̄;
2. client: v_k ← v_k + ρ(θ_k − θ̄), with the θ̄ it received;
3. server: θ̄ ← (1 − δα)·mean_{k∈P} θ_k + α Σ_{all k} v_k, with α = 1/(δ + Kρ).

At a fixed point θ_k = θ̄ for all k, v_k = −∇ℓ_k(θ̄) and Σ_k ∇ℓ_k(θ̄) + δθ̄ = 0. The server keeps
Σ_k v_k itself (``dual_sum.<param>``), applying the same update as the clients, so it never reads
the clients' states; non-participants' duals do not change, and the mean is over participants.

The neural client minimises the mean loss ℓ̄_k = ℓ_k/N_k plus (⟨v_k, θ⟩ + ρ/2‖θ − θ̄‖²)/N_k, which has
the same minimiser as step 1: ρ is on the scale of the summed loss (a per-example penalty of ρ/N_k).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from mergeflow.federated.base import (
    MEAN,
    ClientData,
    ClientState,
    FederatedAlgorithm,
    LocalTraining,
    Message,
    ServerState,
    add_prefix,
    exchanged_parameters,
    load_parameters,
    model_parameters,
    take_prefix,
)
from mergeflow.federated.local import local_train
from mergeflow.federated.quadratic_loss import THETA, QuadraticProblem, eye_like, psolve
from mergeflow.schema.federated import FedADMMOptions

DUAL = "dual."
DUAL_SUM = "dual_sum."


class FedADMM(FederatedAlgorithm):
    """FedADMM: local ADMM steps with duals v_k; server θ̄ = (1 − δα)·mean θ_k + αΣv_k."""

    def init_server(self, global_state, num_clients: int, options: FedADMMOptions) -> ServerState:
        """θ̄ = the initial parameters, Σv = 0."""
        server = super().init_server(global_state, num_clients, options)
        return {**server, **{DUAL_SUM + k[len(MEAN) :]: torch.zeros_like(v) for k, v in server.items()}}

    def init_client(self, global_state, options: FedADMMOptions) -> ClientState:
        """v_k = 0."""
        return {DUAL + k: torch.zeros_like(v, dtype=torch.float64) for k, v in global_state.items()}

    def client_update(
        self,
        model: nn.Module,
        server: ServerState,
        client: ClientState,
        data: ClientData,
        train: LocalTraining,
        options: FedADMMOptions,
        generator: torch.Generator,
    ) -> tuple[Message, ClientState, dict[str, float]]:
        """SGD on ℓ̄_k + (⟨v_k, θ⟩ + ρ/2‖θ − θ̄‖²)/N_k, then v_k += ρ(θ_k − θ̄)."""
        anchor = take_prefix(server, MEAN)
        load_parameters(model, anchor)
        named = dict(exchanged_parameters(model))
        dtype = {k: p.dtype for k, p in named.items()}
        anchors = {k: anchor[k].to(dtype[k]) for k in named}
        duals = {k: client[DUAL + k].to(dtype[k]) for k in named}
        scale = 1.0 / len(data)
        rho = options.rho

        def penalty() -> torch.Tensor:
            total = sum((duals[k] * p).sum() + 0.5 * rho * ((p - anchors[k]) ** 2).sum() for k, p in named.items())
            return scale * total

        metrics = local_train(model, data, train, generator, penalty)
        theta = model_parameters(model)
        new_client = self._dual_step(server, client, theta, options)
        metrics["primal_residual"] = _distance(theta, anchor)
        return add_prefix(MEAN, theta), new_client, metrics

    @staticmethod
    def _dual_step(server: ServerState, client: ClientState, theta: dict, options: FedADMMOptions) -> ClientState:
        return {DUAL + k: client[DUAL + k] + options.rho * (theta[k] - server[MEAN + k]) for k in theta}

    def server_update(
        self,
        server: ServerState,
        messages: Mapping[int, Message],
        sizes: Mapping[int, int],
        num_clients: int,
        options: FedADMMOptions,
    ) -> ServerState:
        """Σv += ρ(θ_k − θ̄) for k ∈ P; θ̄ = (1 − δα)·mean_P θ_k + αΣv, α = 1/(δ + Kρ)."""
        if not messages:
            raise ValueError("a server update needs at least one message")
        alpha = 1.0 / (options.prior_precision + num_clients * options.rho)
        new = dict(server)
        for name, mean in take_prefix(server, MEAN).items():
            thetas = [messages[k][MEAN + name].to(torch.float64) for k in messages]
            dual_sum = server[DUAL_SUM + name] + sum(options.rho * (t - mean) for t in thetas)
            avg = sum(thetas) / len(thetas)
            new[DUAL_SUM + name] = dual_sum
            new[MEAN + name] = (1.0 - options.prior_precision * alpha) * avg + alpha * dual_sum
        return new

    def exact_client_update(
        self, server: ServerState, client: ClientState, problem: QuadraticProblem, options: FedADMMOptions
    ) -> tuple[Message, ClientState, dict[str, float]]:
        """θ_k = (H_k + ρI)⁻¹(b_k − v_k + ρθ̄), then the dual step."""
        anchor = server[MEAN + THETA]
        rho = options.rho
        lhs = problem.H + rho * eye_like(problem.H, problem.b)
        theta = psolve(lhs, problem.b - client[DUAL + THETA] + rho * anchor)
        new_client = self._dual_step(server, client, {THETA: theta}, options)
        return {MEAN + THETA: theta}, new_client, {"loss": problem.loss(theta)}


def _distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    return float(sum(((a[k] - b[k].to(torch.float64)) ** 2).sum() for k in a)) ** 0.5
