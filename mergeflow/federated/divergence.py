"""What a round does with a client whose local training diverged (``federated.on_divergence``).

A diverged client update (non-finite loss, a non-finite or non-positive IVON posterior, or a
client whose drift ran away, :func:`guard_runaway`) is recorded, not raised, by
:func:`guarded_client_update`: no message, the client's state unchanged.
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
FIRST_DISTANCE = "runaway_first_distance"  # client state: its distance ‖θ_k − θ̄‖ in its first round
DISTANCES = "runaway_distances"  # client state: its last distances after the first round, oldest first


def guard_runaway(
    client: ClientState, distance: float, window: int, growth: float, scale: float = 0.0
) -> dict[str, torch.Tensor]:
    """The client's distance record with ``distance`` added, unless the client has run away.

    A client that sent ``distance`` = ‖θ_k − θ̄‖ from the model it started at has run away when
    ``distance`` is more than ``growth`` × the largest of: the smallest of its last ``window``
    distances after its first round (it needs two of them: a single one may be an outlier), its
    first round's distance, and ``scale``. A healthy client's distance shrinks or levels off as the
    duals settle; one in a run-away loop grows geometrically (IVON-ADMM at small Kρ: 1.4× a round
    or faster, :mod:`.flat_direction`), so the check starts early rather than when the window is
    full: by then the old IVON-ADMM defaults had sent a distance of 4e13 on one run.

    Against the window alone, a converged client whose tiny distances vary by orders of magnitude
    would count as run away, and so would a client whose first steps were damped (IVON starts at
    ``hess_init``) and whose later ones are not. The first round's distance is the scale of one
    round of local training, and ``scale`` one the algorithm knows (IVON-ADMM: a prior standard
    deviation, 1/√δ). ``window`` = 0 turns the check off.

    Returns:
        The entries to store in the client's state: the first distance and the last ``window``
        later ones (nothing when the check is off).

    Raises:
        DivergenceError: when the client has run away, saying by how much and what to change.
    """
    if window == 0:
        return {}
    if FIRST_DISTANCE not in client:
        # Bookkeeping scalars, on the CPU whatever device the model trains on.
        first = torch.tensor(distance, dtype=torch.float64, device="cpu")
        return {FIRST_DISTANCE: first, DISTANCES: torch.zeros(0, dtype=torch.float64, device="cpu")}
    history = client[DISTANCES]
    if len(history) >= min(2, window):
        reference = max(float(history.min()), float(client[FIRST_DISTANCE]), scale)
        if distance > growth * reference:
            raise DivergenceError(
                f"client drift ran away: its distance from the global model, {distance:.3g}, is more than "
                f"{growth:g}x its smallest over its last {len(history)} rounds, its first round's and its scale's "
                f"(the largest: {reference:.3g}); raise the algorithm's rho or lower its lr "
                "(docs/results.md: IVON-ADMM's stable region)"
            )
    appended = torch.cat([history.cpu(), torch.tensor([distance], dtype=torch.float64, device="cpu")])
    return {DISTANCES: appended[-window:]}


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
