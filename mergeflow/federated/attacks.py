"""Byzantine attacks, the implementations of those declared in ``mergeflow.schema.federated``
(:data:`~mergeflow.schema.federated.ATTACKS`).

A model attack rewrites what an attacker sends for each parameter (its honest update Δ_k = θ_k − θ̄ is
what it would have sent; :func:`mergeflow.federated.server_plan.attack_message` applies it);
``label_flip`` poisons the attacker's training data instead, so its message is honest training on
flipped labels. Who attacks is drawn once per run (:func:`mergeflow.federated.server_plan.attackers`).
"""

from __future__ import annotations

import torch

from mergeflow.federated.base import ClientData
from mergeflow.schema.federated import AttackOptions


def sign_flip(
    anchor: torch.Tensor, theta: torch.Tensor, options: AttackOptions, generator: torch.Generator
) -> torch.Tensor:
    """θ̄ − scale·Δ_k."""
    return anchor - options.scale * (theta - anchor)


def scaled(
    anchor: torch.Tensor, theta: torch.Tensor, options: AttackOptions, generator: torch.Generator
) -> torch.Tensor:
    """Model replacement: θ̄ + scale·Δ_k."""
    return anchor + options.scale * (theta - anchor)


def gaussian(
    anchor: torch.Tensor, theta: torch.Tensor, options: AttackOptions, generator: torch.Generator
) -> torch.Tensor:
    """θ̄ + ε, ε ~ N(0, scale²) per coordinate, drawn from ``generator``."""
    noise = torch.randn(anchor.shape, generator=generator, dtype=anchor.dtype, device=generator.device)
    return anchor + options.scale * noise.to(anchor.device)


def flip_labels(data: ClientData, num_classes: int) -> ClientData:
    """The client's data with every class label y replaced by C − 1 − y."""
    return ClientData(data.X, (num_classes - 1) - data.y, data.task)
