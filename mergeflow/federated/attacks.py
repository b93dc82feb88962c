"""Byzantine clients, to test the aggregators: who attacks, and what an attacker sends or trains on.

The attackers are drawn once per run from the seed. Model attacks rewrite the message an attacker
sends (its honest update Δ_k = θ_k − θ̄ is what it would have sent); ``label_flip`` poisons the
attacker's training data instead, so its message is honest training on flipped labels.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mergeflow.federated.base import MEAN, ClientData, Message
from mergeflow.schema.federated import AttackOptions
from mergeflow.seeding import derive_seed


def attackers(num_clients: int, options: AttackOptions | None, seed: int) -> list[int]:
    """The sorted ids of the attacking clients, drawn without replacement from (seed, "attack")."""
    if options is None or options.clients == 0:
        return []
    if options.clients > num_clients:
        raise ValueError(f"federated.attack.clients: {options.clients} attackers but only {num_clients} clients")
    generator = torch.Generator().manual_seed(derive_seed(seed, "attack"))
    return sorted(torch.randperm(num_clients, generator=generator, device=generator.device)[: options.clients].tolist())


def attack_message(
    message: Message, server_mean: Mapping[str, torch.Tensor], options: AttackOptions, generator: torch.Generator
) -> Message:
    """What an attacker sends instead of ``message`` (θ_k under ``mean.<param>``); other keys unchanged.

    ``server_mean`` is the global model θ̄ the client started from (parameter name → tensor).
    """
    if options.poisons_data:
        return dict(message)
    attacked = dict(message)
    for name in sorted(server_mean):
        anchor = server_mean[name]
        theta = message[MEAN + name].to(anchor.dtype)
        if options.kind == "sign_flip":
            attacked[MEAN + name] = anchor - options.scale * (theta - anchor)
        elif options.kind == "scaled":
            attacked[MEAN + name] = anchor + options.scale * (theta - anchor)
        else:
            noise = torch.randn(anchor.shape, generator=generator, dtype=anchor.dtype, device=generator.device)
            attacked[MEAN + name] = anchor + options.scale * noise.to(anchor.device)
    return attacked


def flip_labels(data: ClientData, num_classes: int) -> ClientData:
    """The client's data with every class label y replaced by C − 1 − y."""
    return ClientData(data.X, (num_classes - 1) - data.y, data.task)
