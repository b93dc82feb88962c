"""Deterministic mini-batch training and batched prediction.

Shuffling uses an explicit :class:`torch.Generator` seeded from ``seed``; the
global torch RNG is never touched, so concurrent trainings in different
threads stay bit-reproducible. Training and prediction run on the model's device: the data stay
on the CPU and each batch moves there as it is used (pinned, without blocking, on a GPU); the
shuffling generator stays on the CPU, so a seed draws the same batches on every device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

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
    """Loss history of one :func:`train` call.

    Attributes:
        losses: mean mini-batch loss of every optimisation step.
        epoch_losses: mean loss over the examples of every epoch.
    """

    losses: list[float] = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)


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
    total: float = 0.0
    unread: list[tuple[int, int, Callable[[], float]]] = field(default_factory=list)  # (step, rows, read)

    def add(self, step: int, rows: int, loss: torch.Tensor) -> None:
        self.unread.append((step, rows, _read_later(loss)))

    def settle(self, through: float) -> None:
        """Read the losses of the steps up to ``through``: into the history, or a DivergenceError."""
        while self.unread and self.unread[0][0] <= through:
            step, rows, read = self.unread.pop(0)
            value = read()
            if not math.isfinite(value):
                raise DivergenceError(f"non-finite training loss {value} at epoch {self.epoch}, step {step}")
            self.result.losses.append(value)
            self.total += value * rows


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


def train(
    model: nn.Module,
    X: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    *,
    task: str | Objective,
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
    """Train ``model`` in place with mini-batches reshuffled every epoch.

    The loss and targets are the objective's: classification minimises cross-entropy on the logits;
    regression ``0.5 * mean((output[:, 0] - y) ** 2)``; a causal LM the mean next-token cross-entropy
    (``y`` is then unused: the targets are the inputs shifted by one).

    Args:
        model: the model to train (modified in place).
        X: inputs, shape ``(N, *input_shape)``.
        y: class indices (classification) or targets (regression), shape ``(N,)``.
        task: a registered objective (:mod:`mergeflow.objectives`), or its name.
        epochs: number of passes over the data.
        lr: learning rate.
        optimizer: a key of :data:`OPTIMIZERS` (``"sgd"`` or ``"adam"``).
        momentum: SGD momentum.
        weight_decay: L2 penalty passed to the optimizer.
        batch_size: mini-batch size (the last batch of an epoch may be smaller).
        seed: seed of the shuffling generator.
        progress: if given, show a tqdm bar over epochs with this description.
        on_epoch: called with the epoch's index after each epoch (e.g. to score the model on validation).
        precision: ``fp32``, or ``bf16``/``fp16`` autocast of the forward pass and loss (fp16 with a
            gradient scaler); the weights keep their dtype.

    Returns:
        The per-step and per-epoch loss history.

    Raises:
        DivergenceError: once a mini-batch loss is non-finite, read one step later (on a GPU the host
            queues the next step before it waits for a loss); the weights are then meaningless.
        ValueError: on an unknown task or optimizer.
    """
    inputs = as_inputs(X)
    objective = get_objective(task)
    targets, loss_fn = objective.targets(y, inputs, model), objective.loss
    opt = make_optimizer(optimizer, model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(int(seed))
    n = inputs.shape[0]
    lengths = token_lengths(model, inputs)
    device = module_device(model)
    inputs, targets = resident((inputs, targets), device)  # a small split goes to the device whole
    scaler = grad_scaler(device, precision)
    result = TrainResult()
    bar = tqdm(range(epochs), desc=progress, leave=False, disable=None) if progress else None
    model.train()
    for epoch in bar if bar is not None else range(epochs):
        losses = _EpochLosses(epoch, result)
        for step, idx in enumerate(_on(list(minibatches(n, batch_size, gen, lengths)), inputs.device)):
            cancel.check()
            batch, batch_targets = to_device(inputs[idx], device), to_device(targets[idx], device)
            with autocast(device, precision):
                loss = loss_fn(model(batch), batch_targets)
            losses.add(step, len(idx), loss)
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
