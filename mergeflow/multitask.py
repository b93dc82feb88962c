"""Joint multi-task training: one body shared by K task models, each with its own head, on the K tasks' data.

This is the multi-task ceiling (the analogue of the centralized oracle: one body trained on every
task at once) and the joint pre-training of a shared base.

Protocol (:func:`train_jointly`):

- The K models are one model per task, of one architecture but for their heads (e.g. built with
  :func:`mergeflow.heads.task_base` from one state). Their bodies are made one: every body parameter of
  every model becomes the first model's ``nn.Parameter`` object (:func:`tie_bodies`), so there is one
  set of body weights and nothing is copied between models during training.
- One optimizer holds the body once and the K heads. Each epoch draws every task's shuffled batches
  from one generator seeded with ``seed`` (in the tasks' order), then walks them round-robin: task 1's
  first batch, task 2's first, …, task 1's second, …; a task with fewer batches stops early in that
  epoch (:func:`mergeflow.training.round_robin`).
- A step's loss is its own task's loss of its own model (its own head): the gradient reaches the
  shared body and that task's head only. The other heads get no gradient, and the optimizer leaves them
  as they are (no weight decay, no momentum step).

The loop is :func:`mergeflow.training.fit`, the one :func:`mergeflow.training.train` runs, so precision,
cancellation, divergence checks and the loss history are the same; with one task it is ``train``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Unpack

import numpy as np
import torch
from torch import nn

from mergeflow.models.token_model import tied_aliases
from mergeflow.objectives import Objective, get_objective
from mergeflow.training import Part, TrainOptions, TrainResult, fit

Data = tuple[np.ndarray | torch.Tensor, np.ndarray | torch.Tensor]


def tie_bodies(models: Sequence[nn.Module], heads: Collection[str]) -> None:
    """Make every body parameter (every parameter not named in ``heads``) of every model the first model's
    ``nn.Parameter`` object, in place; each model keeps its own head. Tied weights inside a model (GPT-2's
    output layer and token embedding) stay tied.

    Raises:
        ValueError: naming a head that a model lacks, or a body parameter that a model lacks or holds with
            another shape or other values than the first model (the tasks must start from one body).
    """
    shared = dict(models[0].named_parameters())
    for k, model in enumerate(models):
        own = dict(model.named_parameters())
        missing = [name for name in heads if name not in own]
        if missing:
            raise ValueError(f"model {k} has no head parameter {missing[0]!r}")
        for name in [*shared, *(name for name in own if name not in shared)]:
            if name in heads:
                continue
            if name not in own or name not in shared or not _same(own[name], shared[name]):
                raise ValueError(f"model {k} and model 0 differ at body parameter {name!r}: they need one body")
        aliases = tied_aliases(model)
        for name, _ in list(model.named_parameters(remove_duplicate=False)):
            source = aliases.get(name, name)
            if source not in heads:
                _set_parameter(model, name, shared[source])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b))


def _set_parameter(model: nn.Module, name: str, parameter: nn.Parameter) -> None:
    owner, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(owner), attribute, parameter)


def train_jointly(
    models: Mapping[str, nn.Module],
    data: Mapping[str, Data],
    *,
    heads: Collection[str],
    task: str | Objective,
    **options: Unpack[TrainOptions],
) -> TrainResult:
    """Train one body shared by the task models, each with its own head, on every task's data (the protocol
    above); the models are changed in place and share their body afterwards (:func:`tie_bodies`).

    Args:
        models: one model per task, by task name, in the tasks' order; they start from one body.
        data: each task's training inputs and labels, by the same names (in any order).
        heads: the state-dict keys of the head (:func:`mergeflow.heads.head_names`).
        task: the objective (or its name) every task is trained for.
        options: as :func:`mergeflow.training.train`'s (``epochs``, ``lr``, ``optimizer``, ``seed``, …).

    Returns:
        The loss history: every step's loss in the order taken, the mean loss over all tasks' examples every
        epoch, and each task's own (``part_epoch_losses``, in the tasks' order).

    Raises:
        ValueError: when ``models`` and ``data`` name different tasks, or as :func:`tie_bodies`.
        DivergenceError: as :func:`mergeflow.training.train`.
    """
    if set(models) != set(data):
        raise ValueError(f"the models' tasks {sorted(models)} are not the data's {sorted(data)}")
    if not models:
        raise ValueError("train_jointly needs at least one task")
    tie_bodies(list(models.values()), heads)
    objective = get_objective(task)
    return fit([Part.of(models[name], *data[name], objective) for name in models], **options)
