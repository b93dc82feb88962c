"""Finding permutations: weight matching (Git Re-Basin), activation matching, and aligning many clients.

Both methods align ``other`` to ``reference``: the returned permutations, applied to the other
model with :func:`apply_permutation`, make its units correspond to the reference's.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn

from mergeflow.align.permute import apply_permutation, permute_tensor
from mergeflow.align.spec import PermutationSpec
from mergeflow.device import host_tensor, module_device, to_device

State = Mapping[str, torch.Tensor]
METRICS = ("correlation", "l2")
METHODS = ("weights", "activations")
_TOL = 1e-12


@dataclass
class MatchResult:
    """Permutations found for each group, and the matching objective.

    Attributes:
        perms: group name → LongTensor permutation (new unit ``i`` is the other model's unit ``perms[g][i]``).
        objectives: the objective at the identity, then after every sweep (weight matching:
            Σ ⟨W_ref, π(W_other)⟩ over the permuted tensors; activation matching: the summed
            similarity of matched units).
        converged: whether the last sweep found no improvement.
    """

    perms: dict[str, torch.Tensor]
    objectives: list[float] = field(default_factory=list)
    converged: bool = True


def _units(tensor: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    """Rows = units: ``axis`` (n blocks) to the front, everything else flattened."""
    return tensor.movedim(axis, 0).reshape(n, -1)


def _solve(score: torch.Tensor) -> torch.Tensor:
    """The permutation maximising Σ_i score[i, p[i]]."""
    _, cols = linear_sum_assignment(score.detach().cpu().numpy(), maximize=True)
    return host_tensor(cols, torch.long)


def _matched(score: torch.Tensor, perm: torch.Tensor) -> float:
    return float(score[torch.arange(len(perm), device=score.device), perm.to(score.device)].sum())


def _float64(state: State, keys: Sequence[str], which: str) -> dict[str, torch.Tensor]:
    missing = [k for k in keys if k not in state]
    if missing:
        raise KeyError(f"{which} state lacks keys of the spec: {missing}")
    return {k: state[k].detach().to(torch.float64) for k in keys}


def weight_objective(spec: PermutationSpec, reference_state: State, other_state: State, perms) -> float:
    """Σ ⟨W_ref, π(W_other)⟩ over the tensors the spec touches (float64)."""
    keys = spec.keys()
    ref = _float64(reference_state, keys, "reference")
    other = apply_permutation(spec, _float64(other_state, keys, "other"), perms)
    return float(sum((ref[k] * other[k]).sum() for k in keys))


def weight_matching(
    spec: PermutationSpec,
    reference_state: State,
    other_state: State,
    *,
    max_iter: int = 100,
    seed: int = 0,
) -> MatchResult:
    """Git Re-Basin weight matching: permutations of ``other`` maximising Σ ⟨W_ref, π(W_other)⟩.

    Coordinate ascent from the identity: each step solves one linear assignment problem for
    one group with the others fixed, visiting groups in a random order (a numpy generator
    seeded with ``seed``) each sweep, until a sweep improves nothing by more than 1e-12 or
    ``max_iter`` sweeps have run. A step's permutation is kept only if it improves, so the
    objective never decreases. No data is needed; all arithmetic is float64.
    """
    keys = spec.keys()
    ref = _float64(reference_state, keys, "reference")
    other = _float64(other_state, keys, "other")
    by_key = spec.by_key()
    perms = spec.identity()
    names = list(spec.groups)
    rng = np.random.default_rng(seed)
    objectives = [weight_objective(spec, ref, other, perms)]
    converged = not names
    for _ in range(max_iter if names else 0):
        progress = False
        for index in rng.permutation(len(names)):
            name = names[index]
            n = spec.groups[name].size
            score = torch.zeros(n, n, dtype=torch.float64, device=next(iter(ref.values())).device)
            for key, axis, _block in spec.groups[name].axes:
                tensor = other[key]
                for group, other_axis, block in by_key[key]:
                    if group != name:
                        tensor = permute_tensor(tensor, other_axis, perms[group], block)
                score += _units(ref[key], axis, n) @ _units(tensor, axis, n).T
            candidate = _solve(score)
            if _matched(score, candidate) > _matched(score, perms[name]) + _TOL:
                perms[name] = candidate
                progress = True
        objectives.append(weight_objective(spec, ref, other, perms))
        if not progress:
            converged = True
            break
    return MatchResult(perms, objectives, converged)


def _record(model: nn.Module, spec: PermutationSpec, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each group's activations at its probe as (samples, units) float64; conv positions are samples."""
    modules = dict(model.named_modules())
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name, group in spec.groups.items():
        if group.probe is None:
            raise ValueError(f"group {name!r} has no probe; derive the spec with permutation_spec")

        def hook(module, args, output, name=name, probe=group.probe, n=group.size):
            units = output.movedim(probe.axis, -1).reshape(-1, n, probe.block).transpose(1, 2)
            seen[name] = units.reshape(-1, n).to(torch.float64)

        handles.append(modules[group.probe.module].register_forward_hook(hook))
    try:
        model(x)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def activation_matching(
    spec: PermutationSpec,
    model_ref: nn.Module,
    model_other: nn.Module,
    inputs: torch.Tensor | np.ndarray,
    *,
    metric: str = "correlation",
    batch_size: int = 256,
) -> MatchResult:
    """Match units by their activations on the same inputs: one LAP per group.

    Activations are recorded at each group's probe (the output of the last module before
    the next layer consumes the units, e.g. the ReLU after a hidden Linear, or the pooled
    conv features), in eval mode; for convolutions every spatial position is a sample. An
    activation applied functionally inside ``forward`` (``torch.relu(self.fc(x))``) is invisible
    to hooks, so such a model is matched on pre-activations.

    Args:
        metric: ``"correlation"`` maximises the summed Pearson correlation of matched units;
            ``"l2"`` minimises their summed mean squared difference.
        batch_size: examples per forward pass; statistics accumulate in float64.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {METRICS}")
    param = next(model_ref.parameters())
    x_all = host_tensor(inputs).to(dtype=param.dtype)  # on the CPU: a batch at a time goes to the device
    sums: dict[str, dict[str, torch.Tensor | float]] = {}
    modes = model_ref.training, model_other.training
    model_ref.eval()
    model_other.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(x_all), batch_size):
                x = to_device(x_all[start : start + batch_size], module_device(model_ref))
                acts_a, acts_b = _record(model_ref, spec, x), _record(model_other, spec, x)
                for name in spec.groups:
                    a, b = acts_a[name], acts_b[name]
                    s = sums.setdefault(name, {"n": 0.0, "a": 0, "b": 0, "aa": 0, "bb": 0, "ab": 0})
                    s["n"] += a.shape[0]
                    s["a"] += a.sum(0)
                    s["b"] += b.sum(0)
                    s["aa"] += (a * a).sum(0)
                    s["bb"] += (b * b).sum(0)
                    s["ab"] += a.T @ b
    finally:
        model_ref.train(modes[0])
        model_other.train(modes[1])
    perms, before, after = {}, 0.0, 0.0
    for name in spec.groups:
        score = _similarity(sums[name], metric)
        perms[name] = _solve(score)
        before += _matched(score, torch.arange(spec.groups[name].size, device=score.device))
        after += _matched(score, perms[name])
    return MatchResult(perms, [before, after], True)


def _similarity(s: dict, metric: str) -> torch.Tensor:
    n = s["n"]
    if metric == "l2":
        return -(s["aa"][:, None] + s["bb"][None, :] - 2 * s["ab"]) / n
    mean_a, mean_b = s["a"] / n, s["b"] / n
    cov = s["ab"] / n - torch.outer(mean_a, mean_b)
    std_a = (s["aa"] / n - mean_a**2).clamp_min(0).sqrt()
    std_b = (s["bb"] / n - mean_b**2).clamp_min(0).sqrt()
    # Dead units (zero variance) get correlation 0 with everything instead of NaN.
    return cov / (torch.outer(std_a, std_b) + 1e-12)


def _loaded(model: nn.Module, state: State) -> nn.Module:
    copy_ = copy.deepcopy(model)
    copy_.load_state_dict(state)
    return copy_


def align_models(
    spec: PermutationSpec,
    reference_state: State,
    states: Sequence[State],
    *,
    method: str = "weights",
    inputs: torch.Tensor | np.ndarray | None = None,
    model: nn.Module | None = None,
    seed: int = 0,
    max_iter: int = 100,
    metric: str = "correlation",
    batch_size: int = 256,
) -> list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """Align every state of ``states`` to ``reference_state`` (which is left unchanged).

    Args:
        method: ``"weights"`` (:func:`weight_matching`, no data) or ``"activations"``
            (:func:`activation_matching`; needs ``inputs`` and a ``model`` of the same
            architecture into which the states are loaded, on copies).

    Returns:
        One ``(aligned_state, perms)`` per input state, in order.
    """
    if method not in METHODS:
        raise ValueError(f"unknown alignment method {method!r}; expected one of {METHODS}")
    if method == "activations" and (inputs is None or model is None):
        raise ValueError("activation alignment needs inputs and a model")
    model_ref = _loaded(model, reference_state) if method == "activations" else None
    out = []
    for state in states:
        if method == "weights":
            result = weight_matching(spec, reference_state, state, max_iter=max_iter, seed=seed)
        else:
            result = activation_matching(
                spec, model_ref, _loaded(model, state), inputs, metric=metric, batch_size=batch_size
            )
        out.append((apply_permutation(spec, state, result.perms), result.perms))
    return out
