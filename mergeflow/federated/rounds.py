"""One federated round, whatever carries states and messages between its steps.

A round is every participant's :func:`client_step`, then one :func:`server_step`, in the order
:func:`round_schedule` gives. The plain loop (:func:`mergeflow.federated.loop.run_rounds`) keeps
states and messages in memory; the pipeline's ``federated`` stage (``tasks/federated.py``) stores
them in files between cached steps. Both drive their rounds with these three functions, so they
compute the same thing by construction and only the transport differs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from torch import nn

from mergeflow.federated.base import (
    ClientData,
    ClientState,
    FederatedAlgorithm,
    LocalTraining,
    Message,
    ServerState,
    client_drift,
    client_generator,
    sample_participants,
)
from mergeflow.federated.divergence import guarded_client_update, surviving_messages
from mergeflow.federated.heads import LocalHeads
from mergeflow.federated.server_plan import ServerPlan, planned_server_update


@dataclass(frozen=True)
class Round:
    """Round ``number`` (from 1): its participants, and the round each one's state was last written in
    (0: its initial state), which a transport that stores states by round reads it from."""

    number: int
    participants: list[int]
    state_rounds: dict[int, int]


def round_schedule(num_clients: int, rounds: int, fraction: float, seed: int, *, poisson: bool = False) -> list[Round]:
    """Rounds 1..``rounds`` with their participants (:func:`~mergeflow.federated.base.sample_participants`;
    ``poisson``: each client independently with probability ``fraction``, as DP-FedAvg samples)."""
    last = dict.fromkeys(range(num_clients), 0)
    schedule = []
    for number in range(1, rounds + 1):
        participants = sample_participants(num_clients, fraction, seed, number - 1, poisson=poisson)
        schedule.append(Round(number, participants, {k: last[k] for k in participants}))
        last |= dict.fromkeys(participants, number)
    return schedule


def client_step(
    algorithm: FederatedAlgorithm,
    model: nn.Module,
    server: ServerState,
    state: ClientState,
    data: ClientData,
    train: LocalTraining,
    options: BaseModel,
    seed: int,
    round_number: int,
    client: int,
    plan: ServerPlan | None = None,
    heads: LocalHeads | None = None,
) -> tuple[Message | None, ClientState, dict[str, Any]]:
    """Client ``client``'s update in round ``round_number``, with its generator from (seed, round, client).

    Returns (message, new state, metrics); a diverged client gives (None, ``state`` unchanged,
    metrics with ``divergence``) (:func:`~mergeflow.federated.divergence.guarded_client_update`).
    A label-flipping attacker of ``plan`` trains on its flipped labels. With ``heads`` the client trains from
    its own head (in its state), sends the body only and keeps its new head in its state.
    """
    generator = client_generator(seed, round_number - 1, client)
    if plan is not None:
        data = plan.training_data(client, data)
    if heads is None:
        return guarded_client_update(algorithm, model, server, state, data, train, options, generator)
    own, head = heads.split(state)
    heads.load(heads.prepare(model), head)
    message, new, metrics = guarded_client_update(algorithm, model, server, own, data, train, options, generator)
    if message is None:
        return None, state, metrics
    return message, heads.with_head(new, heads.head_of(model)), metrics


def head_step(
    algorithm: FederatedAlgorithm,
    heads: LocalHeads,
    model: nn.Module,
    server: ServerState,
    state: ClientState,
    data: ClientData,
    train: LocalTraining,
    seed: int,
    rounds: int,
    client: int,
    plan: ServerPlan | None = None,
) -> ClientState:
    """Client ``client``'s head fine-tuning on the final global body after round ``rounds`` (FedBABU,
    :meth:`~mergeflow.federated.heads.LocalHeads.finetune`), with its generator from (seed, ``rounds``, client),
    the round after the last; returns its state with the fine-tuned head.

    Raises:
        DivergenceError: when the fine-tuning's loss turns non-finite.
    """
    if plan is not None:
        data = plan.training_data(client, data)
    own, head = heads.split(state)
    generator = client_generator(seed, rounds, client)
    tuned, _ = heads.finetune(model, algorithm.global_state(server), head, data, train, generator)
    return heads.with_head(own, tuned)


def server_step(
    algorithm: FederatedAlgorithm,
    server: ServerState,
    sent: Mapping[int, tuple[Message | None, Mapping[str, Any]]],
    sizes: Mapping[int, int],
    num_clients: int,
    options: BaseModel,
    on_divergence: str,
    round_number: int,
    plan: ServerPlan | None = None,
) -> tuple[ServerState, dict[str, Any]]:
    """The server update from what each participant sent (message or None, and its metrics).

    Applies ``on_divergence`` to the diverged participants, then ``server_update`` on the rest (the
    server unchanged when none is left). Returns the new server and the round's row:
    ``participants``, ``train_loss`` (the kept participants' last-epoch losses weighted by n_k),
    ``drift`` (mean ‖θ_k − θ̄‖ from the global model they started at) and ``diverged`` (ids), and what
    ``plan`` adds (:func:`~mergeflow.federated.server_plan.planned_server_update`: attacks, robust
    aggregation, DP, server optimizer).

    Raises:
        DivergenceError: under ``on_divergence: fail`` when a participant diverged.
    """
    reasons = {k: metrics["divergence"] for k, (_, metrics) in sent.items() if "divergence" in metrics}
    outcomes = {k: None if k in reasons else message for k, (message, _) in sent.items()}
    messages = surviving_messages(outcomes, reasons, on_divergence, round_number)
    plan = plan or ServerPlan()
    updated, extra = planned_server_update(algorithm, server, messages, sizes, num_clients, options, plan, round_number)
    losses = {k: metrics.get("train_loss", math.nan) for k, (_, metrics) in sent.items()}
    row = {
        "participants": float(len(sent)),
        "train_loss": weighted_loss(losses, sizes, messages),
        "drift": client_drift(algorithm.global_state(server), messages),
        "diverged": sorted(reasons),
    }
    return updated, row | extra


def weighted_loss(losses: Mapping[int, float], sizes: Mapping[int, int], kept: Mapping[int, Any]) -> float:
    """The clients' last-epoch losses weighted by n_k, over the clients in ``kept`` (nan if none)."""
    total = sum(sizes[k] for k in kept)
    return sum(sizes[k] * losses[k] for k in kept) / total if total else float("nan")
