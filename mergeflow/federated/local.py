"""Local training loops of the clients, with an explicit generator and an optional penalty.

:func:`local_train` is :func:`mergeflow.training.train` (same loss, batching and optimizer; with
``generator = torch.Generator().manual_seed(s)`` and no penalty it is bit-identical to
``train(..., seed=s)``) plus a penalty added to every mini-batch objective, which FedProx and
FedADMM need.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from mergeflow import cancel
from mergeflow.device import module_device, to_device
from mergeflow.federated.base import ClientData, LocalTraining, trained_parameters
from mergeflow.objectives import get_objective
from mergeflow.training import DivergenceError, as_inputs, make_optimizer, minibatches, token_lengths


def prepared(data: ClientData, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """Inputs, targets and loss function of a client, as :func:`mergeflow.training.train` uses them."""
    inputs, objective = as_inputs(data.X), get_objective(data.task)
    return inputs, objective.targets(data.y, inputs, model), objective.loss


def check_finite(value: float, epoch: int, step: int) -> None:
    """Raise :class:`DivergenceError` on a non-finite loss."""
    if not math.isfinite(value):
        raise DivergenceError(f"non-finite training loss {value} at epoch {epoch}, step {step}")


def local_train(
    model: nn.Module,
    data: ClientData,
    train: LocalTraining,
    generator: torch.Generator,
    penalty: Callable[[], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Train ``model`` in place on the mean loss plus ``penalty()`` (evaluated at every step).

    Returns:
        ``{"train_loss": mean data loss of the last epoch (nan without epochs), "steps": count}``.
    """
    inputs, targets, loss_fn = prepared(data, model)
    opt = make_optimizer(
        train.optimizer,
        [p for _, p in trained_parameters(model)],
        lr=train.lr,
        momentum=train.momentum,
        weight_decay=train.weight_decay,
    )
    n = inputs.shape[0]
    lengths = token_lengths(model, inputs)
    device = module_device(model)
    epoch_loss, steps = float("nan"), 0
    model.train()
    for epoch in range(train.epochs):
        total = 0.0
        for step, idx in enumerate(minibatches(n, train.batch_size, generator, lengths)):
            cancel.check()
            loss = loss_fn(model(to_device(inputs[idx], device)), to_device(targets[idx], device))
            value = loss.item()
            check_finite(value, epoch, step)
            objective = loss if penalty is None else loss + penalty()
            opt.zero_grad(set_to_none=True)
            objective.backward()
            opt.step()
            total += value * len(idx)
            steps += 1
        epoch_loss = total / n
    return {"train_loss": epoch_loss, "steps": float(steps)}
