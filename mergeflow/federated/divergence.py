"""What a round does with a client whose local training diverged (``federated.on_divergence``).

A diverged client update (non-finite loss, or a non-finite or non-positive IVON posterior) is
recorded, not raised, by :func:`guarded_client_update`: no message, the client's state unchanged.
The server step then applies the policy with :func:`surviving_messages`: ``fail`` stops the run
with the clients and reasons, ``exclude`` drops those messages for this round only. Keeping the
decision at the server step means changing the policy re-runs no client update.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pydantic import BaseModel
from torch import nn

from mergeflow.federated.base import ClientData, ClientState, FederatedAlgorithm, LocalTraining, Message, ServerState
from mergeflow.training import DivergenceError

DIVERGENCE_POLICIES = ("fail", "exclude")


def guarded_client_update(
    algorithm: FederatedAlgorithm,
    model: nn.Module,
    server: ServerState,
    client: ClientState,
    data: ClientData,
    train: LocalTraining,
    options: BaseModel,
    generator: torch.Generator,
) -> tuple[Message | None, ClientState, dict[str, Any]]:
    """``algorithm.client_update``; a divergence gives (None, ``client`` unchanged, {"divergence": why})."""
    try:
        return algorithm.client_update(model, server, client, data, train, options, generator)
    except DivergenceError as error:
        return None, client, {"divergence": str(error)}


def surviving_messages(
    messages: Mapping[int, Message | None], reasons: Mapping[int, str], policy: str, round_index: int
) -> dict[int, Message]:
    """The messages of the clients that did not diverge (``None`` marks a diverged one).

    Raises:
        DivergenceError: under ``policy`` ``fail`` when any participant diverged, naming each
            client and its reason.
        ValueError: on an unknown policy.
    """
    if policy not in DIVERGENCE_POLICIES:
        raise ValueError(f"unknown divergence policy {policy!r}; expected one of {DIVERGENCE_POLICIES}")
    diverged = [k for k, message in messages.items() if message is None]
    if diverged and policy == "fail":
        detail = "; ".join(f"client {k}: {reasons.get(k, 'diverged')}" for k in diverged)
        raise DivergenceError(
            f"round {round_index}: local training diverged ({detail}); lower the local learning rate "
            "or set federated.on_divergence: exclude to drop a diverged client's message for that round"
        )
    return {k: message for k, message in messages.items() if message is not None}
