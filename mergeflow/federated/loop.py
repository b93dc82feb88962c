"""A plain sequential round loop, without orchestration: the notebook API and the benchmark baseline.

It calls exactly what an orchestrated flow calls (one ``client_update`` per participant with the
generator of :func:`~mergeflow.federated.base.client_generator`, then one ``server_update``), so a
flow with the same seed reproduces it bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel
from torch import nn

from mergeflow.evaluation import evaluate_outputs
from mergeflow.federated.base import (
    ClientData,
    ClientState,
    FederatedAlgorithm,
    LocalTraining,
    ServerState,
    client_drift,
    client_generator,
    get_algorithm,
    load_parameters,
    model_parameters,
    sample_participants,
)
from mergeflow.training import predict


@dataclass
class FederatedRun:
    """Result of :func:`run_rounds`.

    Attributes:
        metrics: one dict per round; index 0 evaluates the initial model (``round`` = 0).
        server: the final server state.
        client_states: the final state of every client.
        global_state: the final model parameters (float64).
    """

    metrics: list[dict[str, float]] = field(default_factory=list)
    server: ServerState = field(default_factory=dict)
    client_states: dict[int, ClientState] = field(default_factory=dict)
    global_state: dict[str, torch.Tensor] = field(default_factory=dict)


def evaluate_global(
    model: nn.Module, params: Mapping[str, torch.Tensor], data: ClientData, *, noise_std: float = 1.0
) -> dict[str, float]:
    """Load ``params`` into ``model`` and return :func:`mergeflow.evaluation.evaluate_outputs` on ``data``."""
    load_parameters(model, params)
    outputs = predict(model, data.X)
    return evaluate_outputs(outputs, data.y.numpy(), task=data.task, noise_std=noise_std)


def _concatenate(clients_data: Sequence[ClientData]) -> ClientData:
    return ClientData(
        torch.cat([torch.as_tensor(d.X) for d in clients_data]),
        torch.cat([torch.as_tensor(d.y) for d in clients_data]),
        clients_data[0].task,
    )


def run_rounds(
    algorithm: str | FederatedAlgorithm,
    model_builder: Callable[[], nn.Module],
    clients_data: Sequence[ClientData],
    rounds: int,
    *,
    options: BaseModel | Mapping[str, Any] | None = None,
    train: LocalTraining | None = None,
    fraction: float = 1.0,
    seed: int = 0,
    eval_data: ClientData | None = None,
    noise_std: float = 1.0,
    callback: Callable[[dict[str, float]], None] | None = None,
) -> FederatedRun:
    """Run ``rounds`` federated rounds sequentially in this process.

    Args:
        algorithm: a key of :data:`~mergeflow.federated.base.ALGORITHMS` or an algorithm instance.
        model_builder: builds the (deterministically initialised) model; called once for the initial
            global model, once per client update and once for evaluation.
        clients_data: the clients' data sets (client id = index).
        rounds: number of rounds.
        options: the algorithm's options (mapping or options model; defaults when None).
        train: local training settings (``LocalTraining()`` when None).
        fraction: fraction of clients per round (:func:`~mergeflow.federated.base.sample_participants`).
        seed: seed of participant sampling and of every client's generator.
        eval_data: data on which the global model is evaluated (all clients' data when None).
        noise_std: noise of the regression NLL.
        callback: called with each round's metrics as soon as they exist.

    Returns:
        A :class:`FederatedRun`. Each round's metrics hold ``round``, ``participants``,
        ``train_loss`` (participants' last-epoch losses weighted by n_k), ``drift`` (mean ‖θ_k − θ̄‖
        from the global model the clients started at) and the evaluation metrics of the new global
        model (accuracy/nll/ece or mse/nll).
    """
    algo = get_algorithm(algorithm)
    opts = algo.parse_options(options)
    train = train or LocalTraining()
    num_clients = len(clients_data)
    if num_clients == 0:
        raise ValueError("run_rounds needs at least one client")
    evaluation = eval_data if eval_data is not None else _concatenate(clients_data)
    eval_model = model_builder()
    initial = model_parameters(eval_model)
    server = algo.init_server(initial, num_clients, opts)
    clients = {k: algo.init_client(initial, opts) for k in range(num_clients)}
    sizes = {k: len(d) for k, d in enumerate(clients_data)}
    run = FederatedRun(server=server, client_states=clients)
    first = {"round": 0.0, **evaluate_global(eval_model, algo.global_state(server), evaluation, noise_std=noise_std)}
    run.metrics.append(first)
    if callback is not None:
        callback(first)
    for r in range(rounds):
        participants = sample_participants(num_clients, fraction, seed, r)
        messages, losses = {}, {}
        for k in participants:
            messages[k], clients[k], client_metrics = algo.client_update(
                model_builder(), server, clients[k], clients_data[k], train, opts, client_generator(seed, r, k)
            )
            losses[k] = client_metrics.get("train_loss", float("nan"))
        started_from = algo.global_state(server)
        server = algo.server_update(server, messages, dict(clients), sizes, num_clients, opts)
        total = sum(sizes[k] for k in participants)
        row = {
            "round": float(r + 1),
            "participants": float(len(participants)),
            "train_loss": sum(sizes[k] * losses[k] for k in participants) / total,
            "drift": client_drift(started_from, messages),
            **evaluate_global(eval_model, algo.global_state(server), evaluation, noise_std=noise_std),
        }
        run.metrics.append(row)
        if callback is not None:
            callback(row)
    run.server, run.client_states, run.global_state = server, clients, algo.global_state(server)
    return run
