"""Linear interpolation between two models and the loss barrier along the path (survey Eq. 1)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

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
) -> BarrierResult:
    """Evaluate ``loss_fn`` on ``n_points`` evenly spaced states between ``a`` and ``b``.

    ``loss_fn(state) -> float`` is the caller's (see :func:`make_loss_fn`), so this works for
    any model. ``metric_fn`` (e.g. :func:`make_accuracy_fn`) is recorded alongside.
    """
    if n_points < 2:
        raise ValueError("n_points must be at least 2 (the endpoints)")
    ts = [float(t) for t in np.linspace(0.0, 1.0, n_points)]
    states = [interpolate(state_a, state_b, t) for t in ts]
    losses = [float(loss_fn(s)) for s in states]
    barrier = max(loss - ((1 - t) * losses[0] + t * losses[-1]) for t, loss in zip(ts, losses, strict=True))
    metrics = [float(metric_fn(s)) for s in states] if metric_fn is not None else None
    return BarrierResult(ts, losses, float(barrier), metrics)


def _outputs_fn(model: nn.Module, X, batch_size: int) -> Callable[[State], torch.Tensor]:
    """A function from a state to the model's outputs on ``X`` (eval mode, no gradients, on a copy); a
    causal LM's per-row summed token NLL and token count (its ``prediction_outputs``)."""
    probe = copy.deepcopy(model).eval()
    forward = getattr(probe, "prediction_outputs", probe)
    param = next(probe.parameters())
    inputs = torch.as_tensor(X).to(param.device, param.dtype)

    @torch.no_grad()
    def outputs(state: State) -> torch.Tensor:
        probe.load_state_dict(state)
        return torch.cat([forward(inputs[i : i + batch_size]) for i in range(0, len(inputs), batch_size)])

    return outputs


def make_loss_fn(model: nn.Module, X, y, *, task: str = "classification", batch_size: int = 1024) -> StateFn:
    """``loss_fn(state)``: the mean loss of ``model`` with ``state`` on ``(X, y)``, as training
    defines it (cross-entropy on logits, ``0.5 · mean((out[:, 0] - y)²)`` for regression, the mean
    next-token cross-entropy for a causal LM)."""
    if task not in ("classification", "regression", "causal_lm"):
        raise ValueError(f"unknown task {task!r}")
    outputs = _outputs_fn(model, X, batch_size)
    targets = torch.as_tensor(y)

    def loss_fn(state: State) -> float:
        out = outputs(state)
        if task == "causal_lm":
            return float(out[:, 0].sum() / out[:, 1].sum())
        if task == "classification":
            return float(F.cross_entropy(out, targets.to(out.device, torch.long).reshape(-1)))
        return float(0.5 * torch.mean((out[:, 0] - targets.to(out.device, out.dtype).reshape(-1)) ** 2))

    return loss_fn


def make_accuracy_fn(model: nn.Module, X, y, *, batch_size: int = 1024) -> StateFn:
    """``accuracy_fn(state)``: the classification accuracy of ``model`` with ``state`` on ``(X, y)``."""
    outputs = _outputs_fn(model, X, batch_size)
    targets = torch.as_tensor(y).to(torch.long).reshape(-1)

    def accuracy_fn(state: State) -> float:
        out = outputs(state)
        return float((out.argmax(1).cpu() == targets).to(torch.float64).mean())

    return accuracy_fn
