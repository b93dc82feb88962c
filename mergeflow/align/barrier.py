"""Linear interpolation between two models and the loss barrier along the path (survey Eq. 1)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mergeflow.device import host_tensor
from mergeflow.objectives import Objective, get_objective
from mergeflow.training import as_inputs

State = Mapping[str, torch.Tensor]
StateFn = Callable[[State], float]


@dataclass
class BarrierResult:
    """Loss (and optional metric) along ``(1 - t) · a + t · b``.

    Attributes:
        ts: interpolation coefficients, from 0 (model a) to 1 (model b).
        losses: ``loss_fn`` at each t.
        barrier: ``max_t [loss(t) - ((1 - t) · loss(0) + t · loss(1))]``; 0 when the path is convex.
        metrics: ``metric_fn`` at each t, if one was given.
    """

    ts: list[float]
    losses: list[float]
    barrier: float
    metrics: list[float] | None = None

    def _mid(self) -> int:
        return int(np.argmin(np.abs(np.asarray(self.ts) - 0.5)))

    @property
    def midpoint_loss(self) -> float:
        """The loss at the t closest to 0.5."""
        return self.losses[self._mid()]

    @property
    def midpoint_metric(self) -> float | None:
        """The metric at the t closest to 0.5 (None without ``metric_fn``)."""
        return None if self.metrics is None else self.metrics[self._mid()]


def interpolate(state_a: State, state_b: State, t: float) -> dict[str, torch.Tensor]:
    """``(1 - t) · a + t · b`` for every floating tensor (exact at t = 0 and 1); integer tensors
    (e.g. BatchNorm's ``num_batches_tracked``) are taken from the nearer endpoint."""
    if set(state_a) != set(state_b):
        raise KeyError(f"the states differ in keys: {sorted(set(state_a) ^ set(state_b))}")
    out = {}
    for key, a in state_a.items():
        b = state_b[key]
        if a.shape != b.shape:
            raise ValueError(f"{key}: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
        if a.is_floating_point():
            out[key] = torch.lerp(a, b.to(a.dtype), float(t))
        else:
            out[key] = (a if t < 0.5 else b).clone()
    return out


def loss_barrier(
    loss_fn: StateFn,
    state_a: State,
    state_b: State,
    *,
    n_points: int = 11,
    metric_fn: StateFn | None = None,
    transform: Callable[[State, float], State] | None = None,
) -> BarrierResult:
    """Evaluate ``loss_fn`` on ``n_points`` evenly spaced states between ``a`` and ``b``.

    ``loss_fn(state) -> float`` is the caller's (see :func:`make_loss_fn`), so this works for
    any model. ``metric_fn`` (e.g. :func:`make_metric_fn`) is recorded alongside. ``transform(state, t)``,
    when given, replaces each interpolated state before it is scored (e.g. REPAIR's rescaling).
    """
    if n_points < 2:
        raise ValueError("n_points must be at least 2 (the endpoints)")
    ts = [float(t) for t in np.linspace(0.0, 1.0, n_points)]
    states = [interpolate(state_a, state_b, t) for t in ts]
    if transform is not None:
        states = [transform(state, t) for state, t in zip(states, ts, strict=True)]
    losses = [float(loss_fn(s)) for s in states]
    barrier = max(loss - ((1 - t) * losses[0] + t * losses[-1]) for t, loss in zip(ts, losses, strict=True))
    metrics = [float(metric_fn(s)) for s in states] if metric_fn is not None else None
    return BarrierResult(ts, losses, float(barrier), metrics)


def _outputs_fn(model: nn.Module, X, batch_size: int, objective: Objective) -> Callable[[State], torch.Tensor]:
    """A function from a state to what the objective keeps of the model's outputs on ``X`` (eval mode, no
    gradients, on a copy): logits, predictions, or a causal LM's per-row summed token NLL and token count."""
    probe = copy.deepcopy(model).eval()
    param = next(probe.parameters())
    inputs = as_inputs(X, param.dtype).to(param.device)  # the barrier's few rows, on the device at once

    @torch.no_grad()
    def outputs(state: State) -> torch.Tensor:
        probe.load_state_dict(state)
        return torch.cat(
            [objective.outputs(probe, inputs[i : i + batch_size]) for i in range(0, len(inputs), batch_size)]
        )

    return outputs


def make_loss_fn(
    model: nn.Module, X, y, *, task: str | Objective = "classification", batch_size: int = 1024
) -> StateFn:
    """``loss_fn(state)``: the mean loss of ``model`` with ``state`` on ``(X, y)``, as training defines it
    for the objective (cross-entropy on logits, ``0.5 · mean((out[:, 0] - y)²)`` for regression, the mean
    next-token cross-entropy for a causal LM)."""
    objective = get_objective(task)
    outputs = _outputs_fn(model, X, batch_size, objective)
    targets = host_tensor(y)

    def loss_fn(state: State) -> float:
        return float(objective.outputs_loss(outputs(state), targets))

    return loss_fn


def make_metric_fn(
    model: nn.Module, X, y, *, task: str | Objective = "classification", batch_size: int = 1024
) -> StateFn:
    """``metric_fn(state)``: the objective's ranking metric (accuracy, MSE, token NLL) of ``model`` with
    ``state`` on ``(X, y)``."""
    objective = get_objective(task)
    outputs = _outputs_fn(model, X, batch_size, objective)
    targets = np.asarray(y)

    def metric_fn(state: State) -> float:
        out = outputs(state).cpu().to(torch.float64).numpy()
        return float(objective.metrics(out, targets, n_bins=15, noise_std=1.0)[objective.declaration.rank_by])

    return metric_fn
