"""FedAvg (McMahan et al. 2017): local epochs, then the server averages the participants' models."""

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
    load_parameters,
    model_parameters,
    participant_weights,
    take_prefix,
)
from mergeflow.federated.local import local_train
from mergeflow.federated.quadratic_loss import THETA, QuadraticProblem, psolve
from mergeflow.schema.federated import FedAvgOptions


def weighted_mean(messages: Mapping[int, Message], weights: Mapping[int, float], prefix: str = MEAN) -> dict:
    """Σ_k w_k · message_k[prefix + name] for every name, in float64."""
    first = next(iter(messages.values()))
    out = {}
    for key in first:
        if key.startswith(prefix):
            out[key] = sum(weights[k] * messages[k][key].to(torch.float64) for k in messages)
    return out


class FedAvg(FederatedAlgorithm):
    """FedAvg: local training from the global model, server average weighted by n_k/N."""

    def penalty(self, model: nn.Module, server: ServerState, client: ClientState, n: int, options):
        """The term added to the local mean loss (none for FedAvg)."""
        return None

    def client_update(
        self,
        model: nn.Module,
        server: ServerState,
        client: ClientState,
        data: ClientData,
        train: LocalTraining,
        options: FedAvgOptions,
        generator: torch.Generator,
    ) -> tuple[Message, ClientState, dict[str, float]]:
        """Load the global model, train locally (with :meth:`penalty`), send the parameters."""
        load_parameters(model, take_prefix(server, MEAN))
        metrics = local_train(model, data, train, generator, self.penalty(model, server, client, len(data), options))
        theta = model_parameters(model)
        return add_prefix(MEAN, theta), self.new_client_state(server, client, theta, options), metrics

    def new_client_state(self, server: ServerState, client: ClientState, theta: dict, options) -> ClientState:
        """The client's state after its local step (unchanged for FedAvg)."""
        return dict(client)

    def server_update(
        self,
        server: ServerState,
        messages: Mapping[int, Message],
        sizes: Mapping[int, int],
        num_clients: int,
        options: FedAvgOptions,
    ) -> ServerState:
        """θ̄ = Σ_{k∈P} w_k θ_k with w_k = n_k / Σ_{j∈P} n_j (or uniform)."""
        weights = participant_weights(messages, sizes, uniform=options.weighting == "uniform")
        return {**server, **weighted_mean(messages, weights)}

    def exact_client_update(
        self, server: ServerState, client: ClientState, problem: QuadraticProblem, options: FedAvgOptions
    ) -> tuple[Message, ClientState, dict[str, float]]:
        """The client minimiser θ_k = H_k⁻¹ b_k."""
        theta = psolve(problem.H, problem.b)
        return {MEAN + THETA: theta}, dict(client), {"loss": problem.loss(theta)}
