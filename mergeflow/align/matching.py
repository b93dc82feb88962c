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

from mergeflow import cancel
from mergeflow.align.permute import apply_permutation, permute_tensor
from mergeflow.align.spec import PermutationSpec, Probe
from mergeflow.device import host_tensor, module_device, to_device
from mergeflow.models.token_model import TokenModel
from mergeflow.training import as_inputs

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


def _units(tensor: torch.Tensor, axis: int, n: int, repeat: int = 1) -> torch.Tensor:
    """Rows = units: ``axis`` (``repeat`` runs of n blocks) to the front, everything else flattened."""
    return tensor.movedim(axis, 0).reshape(repeat, n, -1).transpose(0, 1).reshape(n, -1)


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
        cancel.check()
        progress = False
        for index in rng.permutation(len(names)):
            name = names[index]
            n = spec.groups[name].size
            score = torch.zeros(n, n, dtype=torch.float64, device=next(iter(ref.values())).device)
            for ref_axis in spec.groups[name].axes:
                key, axis, repeat = ref_axis.key, ref_axis.axis, ref_axis.repeat
                tensor = other[key]
                for group, other_axis, block, other_repeat in by_key[key]:
                    if group != name:
                        tensor = permute_tensor(tensor, other_axis, perms[group], block, other_repeat)
                score += _units(ref[key], axis, n, repeat) @ _units(tensor, axis, n, repeat).T
            candidate = _solve(score)
            if _matched(score, candidate) > _matched(score, perms[name]) + _TOL:
                perms[name] = candidate
                progress = True
        objectives.append(weight_objective(spec, ref, other, perms))
        if not progress:
            converged = True
            break
    return MatchResult(perms, objectives, converged)


def _probe_units(output: torch.Tensor, probe: Probe, n: int, keep: torch.Tensor | None) -> torch.Tensor:
    """A probe's activations as (samples, width) float64: width ``n`` (a block's entries are samples),
    or ``n * block`` with ``probe.features`` (unit i's features are columns ``[i * block, (i + 1) * block)``).
    With ``keep`` (the non-padding positions of token inputs), a sequence's padded positions are dropped."""
    axis = probe.axis % output.dim()
    if keep is not None and output.dim() >= 3 and axis >= 2 and output.shape[0] == keep.shape[0]:
        output = output[keep[:, : output.shape[1]]]
        axis -= 1
    units = output.movedim(axis, -1).reshape(-1, n, probe.block)
    if probe.features:
        return units.reshape(-1, n * probe.block).to(torch.float64)
    return units.transpose(1, 2).reshape(-1, n).to(torch.float64)


def _record(model: nn.Module, spec: PermutationSpec, x: torch.Tensor) -> dict[tuple[str, int], torch.Tensor]:
    """Each group's activations at each of its probes, keyed ``(group, probe index)``, as :func:`_probe_units`
    returns them; conv positions and the tokens of a sequence are samples."""
    modules = dict(model.named_modules())
    keep = x != model.pad_token_id if isinstance(model, TokenModel) and not x.is_floating_point() else None
    seen: dict[tuple[str, int], torch.Tensor] = {}
    handles = []
    for name, group in spec.groups.items():
        if not group.probes():
            raise ValueError(f"group {name!r} has no probe; derive the spec with permutation_spec")
        for index, probe in enumerate(group.probes()):

            def store(value: torch.Tensor, key=(name, index), probe=probe, n=group.size) -> None:
                seen[key] = _probe_units(value, probe, n, keep)

            module = modules[probe.module]
            if probe.point == "input":
                handles.append(module.register_forward_pre_hook(lambda m, args, store=store: store(args[0])))
            else:
                handles.append(module.register_forward_hook(lambda m, args, out, store=store: store(out)))
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
    conv features), in eval mode; for convolutions every spatial position is a sample, for token
    models every non-padding token. An activation applied functionally inside ``forward``
    (``torch.relu(self.fc(x))``) is invisible to hooks, so such a model is matched on pre-activations.
    A group with several probes (a transformer's residual stream) sums its similarities over them.
    A probe whose blocks are a unit's features (attention heads) scores two units by the best
    one-to-one pairing of their features (a LAP per pair of units), as Verma & Elbayad (2024)
    match heads.

    Args:
        metric: ``"correlation"`` maximises the summed Pearson correlation of matched units;
            ``"l2"`` minimises their summed mean squared difference.
        batch_size: examples per forward pass; statistics accumulate in float64.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {METRICS}")
    param = next(model_ref.parameters())
    x_all = as_inputs(inputs, param.dtype)  # on the CPU: a batch at a time goes to the device
    sums: dict[tuple[str, int], dict[str, torch.Tensor | float]] = {}
    modes = model_ref.training, model_other.training
    model_ref.eval()
    model_other.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(x_all), batch_size):
                cancel.check()
                x = to_device(x_all[start : start + batch_size], module_device(model_ref))
                acts_a, acts_b = _record(model_ref, spec, x), _record(model_other, spec, x)
                for key, a in acts_a.items():
                    b = acts_b[key]
                    s = sums.setdefault(key, {"n": 0.0, "a": 0, "b": 0, "aa": 0, "bb": 0, "ab": 0})
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
    for name, group in spec.groups.items():
        score = sum(
            _unit_scores(_similarity(sums[(name, i)], metric), probe, group.size)
            for i, probe in enumerate(group.probes())
        )
        perms[name] = _solve(score)
        before += _matched(score, torch.arange(group.size, device=score.device))
        after += _matched(score, perms[name])
    return MatchResult(perms, [before, after], True)


def _unit_scores(similarity: torch.Tensor, probe: Probe, n: int) -> torch.Tensor:
    """(n, n) unit scores: the similarity itself, or for a probe of features, per pair of units the
    similarity of their best one-to-one feature pairing."""
    if not probe.features:
        return similarity
    f = probe.block
    blocks = similarity.reshape(n, f, n, f).transpose(1, 2)
    score = torch.empty(n, n, dtype=similarity.dtype, device=similarity.device)
    for i in range(n):
        for j in range(n):
            score[i, j] = _matched(blocks[i, j], _solve(blocks[i, j]))
    return score


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
