"""Deterministic mini-batch training and batched prediction.

Shuffling uses an explicit :class:`torch.Generator` seeded from ``seed``; the
global torch RNG is never touched, so concurrent trainings in different
threads stay bit-reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

OBJECTIVES = ("classification", "regression", "causal_lm")  # what a model is trained for
IGNORE_INDEX = -100  # positions a token loss skips (padding, and the last position of a causal LM)


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
    inputs = torch.as_tensor(X)
    is_ids = not (inputs.is_floating_point() or inputs.is_complex() or inputs.dtype == torch.bool)
    return inputs.to(torch.long if is_ids else dtype)


# Length buckets: each window of this many batches is sorted by length before it is cut.
_BUCKET_BATCHES = 50


def token_lengths(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
    """Non-padding tokens per row for a model over token ids (one with a ``pad_token_id``), else None."""
    pad = getattr(model, "pad_token_id", None)
    if pad is None or inputs.is_floating_point():
        return None
    return (inputs != pad).sum(1)


def minibatches(
    n: int, batch_size: int, generator: torch.Generator, lengths: torch.Tensor | None = None
) -> Iterator[torch.Tensor]:
    """Index batches of one epoch from a fresh permutation drawn from ``generator``.

    With ``lengths`` (tokens per row), batches are length-bucketed: each window of 50 batches of
    the permutation is sorted by length before it is cut, and the batches are then shuffled, so a
    batch of short texts is not padded to the longest text of the epoch.
    """
    order = torch.randperm(n, generator=generator)
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
    for i in torch.randperm(len(batches), generator=generator).tolist():
        yield batches[i]


def next_token_labels(ids: torch.Tensor, pad: int) -> torch.Tensor:
    """Causal-LM targets of right-padded ids: each position predicts the next token; padding and the
    last position are :data:`IGNORE_INDEX`."""
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = torch.where(ids[:, 1:] != pad, ids[:, 1:], IGNORE_INDEX)
    return labels


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``(N, L', V)`` token logits against ``(N, L)`` labels, over the positions that are
    not :data:`IGNORE_INDEX`; labels are cut to the ``L'`` columns the model kept (it drops columns that
    are padding in every row, whose labels are all ignored)."""
    labels = labels[:, : logits.shape[1]]
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction=reduction
    )


def task_targets(task: str, y: np.ndarray | torch.Tensor, inputs: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """The training targets of a task: class ids, float targets, or (causal LM) the next tokens of ``inputs``."""
    if task == "classification":
        return torch.as_tensor(y).to(torch.long).reshape(-1)
    if task == "regression":
        return torch.as_tensor(y).to(torch.float32).reshape(-1)
    if task == "causal_lm":
        return next_token_labels(inputs, model.pad_token_id)
    raise ValueError(f"unknown task {task!r}; expected one of {OBJECTIVES}")


def _half_mse(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.mean((out[:, 0] - t) ** 2)


LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "classification": F.cross_entropy,
    "regression": _half_mse,
    "causal_lm": token_cross_entropy,
}


def train(
    model: nn.Module,
    X: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    *,
    task: str,
    epochs: int,
    lr: float,
    optimizer: str = "sgd",
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    batch_size: int = 32,
    seed: int = 0,
    progress: str | None = None,
    on_epoch: Callable[[int], None] | None = None,
) -> TrainResult:
    """Train ``model`` in place with mini-batches reshuffled every epoch.

    Classification minimises cross-entropy on the logits; regression minimises
    ``0.5 * mean((output[:, 0] - y) ** 2)``; a causal LM the mean next-token cross-entropy (``y``
    is then unused: the targets are the inputs shifted by one).

    Args:
        model: the model to train (modified in place).
        X: inputs, shape ``(N, *input_shape)``.
        y: class indices (classification) or targets (regression), shape ``(N,)``.
        task: one of :data:`OBJECTIVES`.
        epochs: number of passes over the data.
        lr: learning rate.
        optimizer: a key of :data:`OPTIMIZERS` (``"sgd"`` or ``"adam"``).
        momentum: SGD momentum.
        weight_decay: L2 penalty passed to the optimizer.
        batch_size: mini-batch size (the last batch of an epoch may be smaller).
        seed: seed of the shuffling generator.
        progress: if given, show a tqdm bar over epochs with this description.
        on_epoch: called with the epoch's index after each epoch (e.g. to score the model on validation).

    Returns:
        The per-step and per-epoch loss history.

    Raises:
        DivergenceError: as soon as a mini-batch loss is non-finite.
        ValueError: on an unknown task or optimizer.
    """
    inputs = as_inputs(X)
    targets, loss_fn = task_targets(task, y, inputs, model), LOSSES[task]
    opt = make_optimizer(optimizer, model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(int(seed))
    n = inputs.shape[0]
    lengths = token_lengths(model, inputs)
    result = TrainResult()
    bar = tqdm(range(epochs), desc=progress, leave=False, disable=None) if progress else None
    model.train()
    for epoch in bar if bar is not None else range(epochs):
        total = 0.0
        for step, idx in enumerate(minibatches(n, batch_size, gen, lengths)):
            loss = loss_fn(model(inputs[idx]), targets[idx])
            value = loss.item()
            if not math.isfinite(value):
                raise DivergenceError(f"non-finite training loss {value} at epoch {epoch}, step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            result.losses.append(value)
            total += value * len(idx)
        result.epoch_losses.append(total / n)
        if bar is not None:
            bar.set_postfix(loss=f"{total / n:.4g}")
        if on_epoch is not None:
            on_epoch(epoch)
    return result


@torch.no_grad()
def predict(model: nn.Module, X: np.ndarray | torch.Tensor, *, batch_size: int = 1024) -> np.ndarray:
    """Raw model outputs (logits or regression outputs) as float64 numpy.

    A model with a ``prediction_outputs`` method (a causal LM: per-row summed token NLL and token
    count) gives those instead of its forward's outputs. Runs in eval mode without gradients; the
    model's previous train/eval mode is restored afterwards.
    """
    inputs = as_inputs(X)
    forward = getattr(model, "prediction_outputs", model)
    was_training = model.training
    model.eval()
    try:
        outputs = [forward(inputs[i : i + batch_size]) for i in range(0, inputs.shape[0], batch_size)]
    finally:
        model.train(was_training)
    return torch.cat(outputs).to(torch.float64).numpy()
