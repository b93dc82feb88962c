"""Deterministic mini-batch training and batched prediction.

Shuffling uses an explicit :class:`torch.Generator` seeded from ``seed``; the
global torch RNG is never touched, so concurrent trainings in different
threads stay bit-reproducible. Training and prediction run on the model's device: the data stay
on the CPU and each batch moves there as it is used (pinned, without blocking, on a GPU); the
shuffling generator stays on the CPU, so a seed draws the same batches on every device.

:func:`fit` is the loop: it trains one or several models (:class:`Part`, a model and its split) with one
optimizer, their batches interleaved round-robin; :func:`train` is its one-model case, and
:func:`mergeflow.multitask.train_jointly` the case of K task models sharing one body.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Required, TypedDict, Unpack

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from mergeflow import cancel
from mergeflow.device import autocast, grad_scaler, host_tensor, module_device, resident, to_device
from mergeflow.models.token_model import TokenModel
from mergeflow.objectives import Objective, get_objective


class DivergenceError(RuntimeError):
    """Raised when a training loss becomes non-finite."""


@dataclass
class TrainResult:
    """Loss history of one :func:`train` (or :func:`fit`) call.

    Attributes:
        losses: mean mini-batch loss of every optimisation step.
        epoch_losses: mean loss over the examples of every epoch.
        part_epoch_losses: for each model trained (:func:`train`'s one; :func:`fit`'s parts in order), the
            mean loss over its own examples every epoch.
    """

    losses: list[float] = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)
    part_epoch_losses: list[list[float]] = field(default_factory=list)


def _sgd(params: Iterable[nn.Parameter], *, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


def _adam(params: Iterable[nn.Parameter], *, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    # Adam has its own moment estimates (default betas); ``momentum`` is unused.
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"sgd": _sgd, "adam": _adam}


def make_optimizer(
    name: str,
    params: Iterable[nn.Parameter],
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """Construct the optimizer ``name`` (a key of :data:`OPTIMIZERS`).

    Raises:
        ValueError: on an unknown ``optimizer`` name.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {tuple(OPTIMIZERS)}")
    return OPTIMIZERS[name](params, lr=lr, momentum=momentum, weight_decay=weight_decay)


def as_inputs(X: np.ndarray | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Model inputs as a tensor: features in ``dtype``, token ids (integers) as int64."""
    inputs = host_tensor(X)
    is_ids = not (inputs.is_floating_point() or inputs.is_complex() or inputs.dtype == torch.bool)
    return inputs.to(torch.long if is_ids else dtype)


# Length buckets: each window of this many batches is sorted by length before it is cut.
_BUCKET_BATCHES = 50


def token_lengths(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
    """Non-padding tokens per row for a :class:`TokenModel` over token ids, else None."""
    if not isinstance(model, TokenModel) or inputs.is_floating_point():
        return None
    return (inputs != model.pad_token_id).sum(1)


def minibatches(
    n: int, batch_size: int, generator: torch.Generator, lengths: torch.Tensor | None = None
) -> Iterator[torch.Tensor]:
    """Index batches of one epoch from a fresh permutation drawn from ``generator``.

    With ``lengths`` (tokens per row), batches are length-bucketed: each window of 50 batches of
    the permutation is sorted by length before it is cut, and the batches are then shuffled, so a
    batch of short texts is not padded to the longest text of the epoch.
    """
    order = torch.randperm(n, generator=generator, device=generator.device)
    if lengths is None:
        for start in range(0, n, batch_size):
            yield order[start : start + batch_size]
        return
    window = batch_size * _BUCKET_BATCHES
    batches = []
    for start in range(0, n, window):
        chunk = order[start : start + window]
        chunk = chunk[torch.argsort(lengths[chunk], stable=True)]
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    for i in torch.randperm(len(batches), generator=generator, device=generator.device).tolist():
        yield batches[i]


@dataclass
class _EpochLosses:
    """An epoch's step losses, read on the host as late as the divergence check allows (one step)."""

    epoch: int
    result: TrainResult
    parts: int = 1
    total: float = 0.0
    part_totals: list[float] = field(default_factory=list)
    unread: list[tuple[int, int, int, Callable[[], float]]] = field(default_factory=list)  # (step, rows, part, read)

    def __post_init__(self) -> None:
        self.part_totals = [0.0] * self.parts

    def add(self, step: int, rows: int, loss: torch.Tensor, part: int = 0) -> None:
        self.unread.append((step, rows, part, _read_later(loss)))

    def settle(self, through: float) -> None:
        """Read the losses of the steps up to ``through``: into the history, or a DivergenceError."""
        while self.unread and self.unread[0][0] <= through:
            step, rows, part, read = self.unread.pop(0)
            value = read()
            if not math.isfinite(value):
                raise DivergenceError(f"non-finite training loss {value} at epoch {self.epoch}, step {step}")
            self.result.losses.append(value)
            self.total += value * rows
            self.part_totals[part] += value * rows


def _on(batches: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """An epoch's index batches on ``device``: in one copy, not a blocking copy every step."""
    if device.type == "cpu" or not batches:
        return batches
    return list(torch.cat(batches).to(device).split([len(b) for b in batches]))


def _read_later(loss: torch.Tensor) -> Callable[[], float]:
    """The loss's value, when called. A GPU's loss is copied to pinned memory without blocking, so that
    reading it a step later costs no wait: reading it at once would idle the GPU while the host queues
    the backward pass and the next step."""
    if loss.device.type != "cuda":
        value = loss.item()
        return lambda: value
    host = torch.empty((), dtype=loss.dtype, pin_memory=True)
    host.copy_(loss.detach(), non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> float:
        copied.synchronize()
        return host.item()

    return read


@dataclass(frozen=True)
class Part:
    """One model and its training split, resident where the model is (a split small enough goes there whole):
    a part of a :func:`fit`.

    Attributes:
        model: the model the split trains.
        inputs, targets: the split's inputs and the objective's training targets.
        loss: the objective's mean loss of outputs against targets.
        lengths: tokens per row for a :class:`TokenModel` over token ids (length-bucketed batches), else None.
    """

    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    lengths: torch.Tensor | None

    @classmethod
    def of(
        cls, model: nn.Module, X: np.ndarray | torch.Tensor, y: np.ndarray | torch.Tensor, objective: Objective
    ) -> Part:
        """``model``'s part with inputs ``X`` and labels ``y`` under ``objective``."""
        inputs = as_inputs(X)
        targets = objective.targets(y, inputs, model)
        lengths = token_lengths(model, inputs)
        inputs, targets = resident((inputs, targets), module_device(model))
        return cls(model, inputs, targets, objective.loss, lengths)

    def epoch(self, generator: torch.Generator, batch_size: int) -> list[torch.Tensor]:
        """One epoch's index batches, drawn from ``generator`` (:func:`minibatches`), where the inputs are."""
        return _on(list(minibatches(len(self.inputs), batch_size, generator, self.lengths)), self.inputs.device)


def round_robin(epochs: list[list[torch.Tensor]]) -> Iterator[tuple[int, torch.Tensor]]:
    """``(part, batch)``: the first batch of every part in order, then the second of each, …; a part with fewer
    batches drops out when it has none left."""
    for i in range(max(map(len, epochs), default=0)):
        for part, batches in enumerate(epochs):
            if i < len(batches):
                yield part, batches[i]


class TrainOptions(TypedDict, total=False):
    """The keyword arguments of :func:`fit` (its signature has their defaults and its docstring their
    meaning) that :func:`train` and :func:`mergeflow.multitask.train_jointly` pass on."""

    epochs: Required[int]
    lr: Required[float]
    optimizer: str
    momentum: float
    weight_decay: float
    batch_size: int
    seed: int
    progress: str | None
    on_epoch: Callable[[int], None] | None
    precision: str


def train(
    model: nn.Module,
    X: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    *,
    task: str | Objective,
    **options: Unpack[TrainOptions],
) -> TrainResult:
    """Train ``model`` in place with mini-batches reshuffled every epoch (:func:`fit` with one part).

    The loss and targets are the objective's: classification minimises cross-entropy on the logits;
    regression ``0.5 * mean((output[:, 0] - y) ** 2)``; a causal LM the mean next-token cross-entropy
    (``y`` is then unused: the targets are the inputs shifted by one).

    Args:
        model: the model to train (modified in place).
        X: inputs, shape ``(N, *input_shape)``.
        y: class indices (classification) or targets (regression), shape ``(N,)``.
        task: a registered objective (:mod:`mergeflow.objectives`), or its name.
        options: ``epochs`` and ``lr``, and optionally ``optimizer``, ``momentum``, ``weight_decay``,
            ``batch_size``, ``seed``, ``progress``, ``on_epoch`` and ``precision``: see :func:`fit`.

    Returns:
        The per-step and per-epoch loss history.

    Raises:
        DivergenceError: once a mini-batch loss is non-finite, read one step later (on a GPU the host
            queues the next step before it waits for a loss); the weights are then meaningless.
        ValueError: on an unknown task or optimizer.
    """
    return fit([Part.of(model, X, y, get_objective(task))], **options)


def fit(
    parts: list[Part],
    *,
    epochs: int,
    lr: float,
    optimizer: str = "sgd",
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    batch_size: int = 32,
    seed: int = 0,
    progress: str | None = None,
    on_epoch: Callable[[int], None] | None = None,
    precision: str = "fp32",
) -> TrainResult:
    """Train the parts' models in place, together: one optimizer over all their parameters (a parameter that
    several models share once), every part's split reshuffled every epoch.

    Each epoch draws every part's batches from one generator seeded with ``seed``, in the parts' order, and
    then takes them round-robin (:func:`round_robin`); each step is its own part's loss of its own model's
    outputs. A parameter that a step's model does not use gets no gradient there, and the optimizer leaves it
    as it is (no weight decay, no momentum): :func:`train` is the one part case. The models run on the first
    one's device.

    Args:
        parts: the models and their training splits (:meth:`Part.of`).
        epochs: number of passes over the data.
        lr: learning rate.
        optimizer: a key of :data:`OPTIMIZERS` (``"sgd"`` or ``"adam"``).
        momentum: SGD momentum.
        weight_decay: L2 penalty passed to the optimizer.
        batch_size: mini-batch size (the last batch of a part's epoch may be smaller).
        seed: seed of the shuffling generator.
        progress: if given, show a tqdm bar over epochs with this description.
        on_epoch: called with the epoch's index after each epoch (e.g. to score the model on validation).
        precision: ``fp32``, or ``bf16``/``fp16`` autocast of the forward pass and loss (fp16 with a
            gradient scaler); the weights keep their dtype.

    Returns:
        The per-step and per-epoch loss history, and each part's epoch losses.

    Raises:
        DivergenceError: as :func:`train`.
        ValueError: on an unknown optimizer.
    """
    unique = {id(parameter): parameter for part in parts for parameter in part.model.parameters()}
    opt = make_optimizer(optimizer, list(unique.values()), lr=lr, momentum=momentum, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(int(seed))
    n = sum(len(part.inputs) for part in parts)
    device = module_device(parts[0].model)
    scaler = grad_scaler(device, precision)
    result = TrainResult(part_epoch_losses=[[] for _ in parts])
    bar = tqdm(range(epochs), desc=progress, leave=False, disable=None) if progress else None
    for part in parts:
        part.model.train()
    for epoch in bar if bar is not None else range(epochs):
        losses = _EpochLosses(epoch, result, len(parts))
        for step, (k, idx) in enumerate(round_robin([part.epoch(gen, batch_size) for part in parts])):
            cancel.check()
            part = parts[k]
            batch, batch_targets = to_device(part.inputs[idx], device), to_device(part.targets[idx], device)
            with autocast(device, precision):
                loss = part.loss(part.model(batch), batch_targets)
            losses.add(step, len(idx), loss, k)
            opt.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            losses.settle(step - 1)
        losses.settle(math.inf)
        result.epoch_losses.append(losses.total / n)
        for k, part in enumerate(parts):
            result.part_epoch_losses[k].append(losses.part_totals[k] / len(part.inputs))
        if bar is not None:
            bar.set_postfix(loss=f"{losses.total / n:.4g}")
        if on_epoch is not None:
            on_epoch(epoch)
    return result


@torch.no_grad()
def predict(
    model: nn.Module, X: np.ndarray | torch.Tensor, *, task: str | Objective | None = None, batch_size: int = 1024
) -> np.ndarray:
    """What the objective keeps of the model's outputs, as float64 numpy: logits or regression outputs,
    a causal LM's per-row summed token NLL and token count (``task`` None: the forward's outputs).

    Runs in eval mode without gradients; the model's previous train/eval mode is restored afterwards.
    """
    inputs = as_inputs(X)
    forward = functools.partial(get_objective(task).outputs, model) if task is not None else model
    device = module_device(model)
    was_training = model.training
    model.eval()
    try:
        outputs = [
            forward(to_device(inputs[i : i + batch_size], device)).cpu() for i in range(0, inputs.shape[0], batch_size)
        ]
    finally:
        model.train(was_training)
    return torch.cat(outputs).to(torch.float64).numpy()
