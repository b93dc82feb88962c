"""REPAIR (Jordan et al. 2022, "REPAIR: REnormalizing Permuted Activations for Interpolation Repair").

Interpolating two aligned networks shrinks the variance of their hidden units ("variance collapse"),
which is most of the loss barrier that remains after alignment. REPAIR rescales every unit of the
interpolated model so that its mean and standard deviation over the data are the interpolation of the
endpoints' statistics: for ``(1 - t) · A + t · B``, unit ``i`` gets mean ``(1 - t) μ_A,i + t μ_B,i`` and
standard deviation ``(1 - t) σ_A,i + t σ_B,i`` (the paper's goal statistics). The correction
``z ↦ (z - μ_i) · (σ_goal,i / σ_i) + μ_goal,i`` is affine per unit, so it is folded into the weight
rows and bias of the layer that produces the unit.

Where a unit is corrected (its *repair point*): after its Linear or convolution (the
pre-activation), or after the BatchNorm, LayerNorm or GroupNorm that follows that layer (the
post-norm value, whose own weight and bias absorb the correction), whichever comes last before the
nonlinearity. Points are corrected one at a time in forward order, each measured with the earlier
ones already corrected, so every unit ends at its goal exactly on the data the statistics come from.
The paper's own implementation does the same with inserted BatchNorm layers reset on training data.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mergeflow import cancel
from mergeflow.align.spec import PermutationSpec
from mergeflow.device import to_device
from mergeflow.training import as_inputs

State = Mapping[str, torch.Tensor]
_LAST_AXIS = (nn.Linear, nn.LayerNorm, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))
_CHANNEL_FIRST = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.GroupNorm,
)


@dataclass(frozen=True)
class RepairPoint:
    """Where a group's units are corrected: module ``module`` (a ``named_modules`` name), whose output
    holds the units along ``axis`` and whose ``weight`` rows and ``bias`` produce them."""

    module: str
    axis: int


Statistics = dict[str, tuple[torch.Tensor, torch.Tensor]]


def repair_points(model: nn.Module, spec: PermutationSpec) -> dict[str, RepairPoint]:
    """Each group's repair point: the last module that produces its units with a per-unit weight and bias
    (its Linear or convolution, or a norm after it).

    Raises:
        ValueError: when a group's units have no such module (a layer without bias, a norm without affine
            parameters), since its mean could not be moved.
    """
    modules = dict(model.named_modules())
    points = {}
    for name, group in spec.groups.items():
        owners = [ref.key.rsplit(".", 1)[0] if "." in ref.key else "" for ref in group.axes if ref.axis == 0]
        chosen = None
        for owner in dict.fromkeys(owners):
            module = modules.get(owner)
            affine = module is not None and getattr(module, "weight", None) is not None
            if affine and getattr(module, "bias", None) is not None and isinstance(module, _LAST_AXIS + _CHANNEL_FIRST):
                chosen = RepairPoint(owner, -1 if isinstance(module, _LAST_AXIS) else 1)
        if chosen is None:
            raise ValueError(f"group {name!r}: no layer with a weight and a bias produces its units; REPAIR needs one")
        points[name] = chosen
    return points


def _units(output: torch.Tensor, axis: int) -> torch.Tensor:
    """(samples, units) float64: every other dimension of the output (batch, positions) is a sample."""
    axis %= output.dim()
    return output.movedim(axis, -1).reshape(-1, output.shape[axis]).to(torch.float64)


@torch.no_grad()
def unit_statistics(
    model: nn.Module,
    state: State,
    points: Mapping[str, RepairPoint],
    inputs: torch.Tensor | np.ndarray,
    *,
    batch_size: int = 256,
) -> Statistics:
    """Per group, the mean and standard deviation (population, float64) of each unit at its repair point,
    for ``model`` holding ``state`` (a copy, in eval mode) over ``inputs``."""
    probe = copy.deepcopy(model).eval()
    probe.load_state_dict(state)
    modules = dict(probe.named_modules())
    param = next(probe.parameters())
    x_all = as_inputs(inputs, param.dtype)  # on the CPU: a batch at a time goes to the device
    sums: dict[str, list] = {}
    handles = []
    for name, point in points.items():

        def hook(module, args, output, name=name, axis=point.axis) -> None:
            units = _units(output, axis)
            s = sums.setdefault(name, [0, 0.0, 0.0])
            s[0] += units.shape[0]
            s[1] = s[1] + units.sum(0)
            s[2] = s[2] + (units * units).sum(0)

        handles.append(modules[point.module].register_forward_hook(hook))
    try:
        for start in range(0, len(x_all), batch_size):
            cancel.check()
            probe(to_device(x_all[start : start + batch_size], param.device))
    finally:
        for handle in handles:
            handle.remove()
    out = {}
    for name, (n, total, squares) in sums.items():
        mean = total / n
        out[name] = mean, (squares / n - mean**2).clamp_min(0).sqrt()
    return out


def goal_statistics(endpoints: Sequence[Statistics], weights: Sequence[float]) -> Statistics:
    """The weighted average of the endpoints' means and of their standard deviations, per unit."""
    if len(endpoints) != len(weights) or not endpoints:
        raise ValueError("one weight per endpoint's statistics is needed")
    return {
        name: (
            sum(w * stats[name][0] for w, stats in zip(weights, endpoints, strict=True)),
            sum(w * stats[name][1] for w, stats in zip(weights, endpoints, strict=True)),
        )
        for name in endpoints[0]
    }


def repair(
    model: nn.Module,
    state: State,
    goals: Statistics,
    points: Mapping[str, RepairPoint],
    inputs: torch.Tensor | np.ndarray,
    *,
    batch_size: int = 256,
) -> dict[str, torch.Tensor]:
    """``state`` (an interpolated or merged model) with every unit's statistics at its repair point moved to
    ``goals`` (see :func:`goal_statistics`) on ``inputs``, the correction folded into weights and biases.

    Points are corrected in the order of ``points`` (forward order, as the spec lists its groups), each
    measured after the earlier ones are corrected. A unit with no variance keeps its scale and only
    moves its mean. ``state`` itself is not modified.
    """
    repaired = dict(state)
    for name, point in points.items():
        mean, std = unit_statistics(model, repaired, {name: point}, inputs, batch_size=batch_size)[name]
        goal_mean, goal_std = goals[name]
        scale = torch.where(std > 0, goal_std / std.clamp_min(torch.finfo(std.dtype).tiny), torch.ones_like(std))
        shift = goal_mean - scale * mean
        weight_key, bias_key = f"{point.module}.weight", f"{point.module}.bias"
        weight, bias = repaired[weight_key], repaired[bias_key]
        shape = (-1,) + (1,) * (weight.dim() - 1)
        repaired[weight_key] = (weight.to(torch.float64) * scale.reshape(shape)).to(weight.dtype)
        repaired[bias_key] = (bias.to(torch.float64) * scale + shift).to(bias.dtype)
    return repaired
