"""Deriving a :class:`PermutationSpec` from a model by tracing one dummy forward pass.

Every leaf module's call is recorded (forward hooks) with its input and output shapes; the
calls are then walked in order, following where the current layer's hidden units sit in the
activation. Linear and ConvNd layers open a new group (their output units) and consume the
open one (their input units); normalisation layers, per-channel PReLU and Flatten carry it on;
parameter-free modules that keep the unit axis (activations, pooling, Dropout) pass it through.
Whatever cannot be followed safely (an unsupported layer, a reshape that scatters units, the
model's output) leaves that group unpermuted. The result is then checked: a random
permutation from the spec must leave the model's outputs unchanged.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from mergeflow.align.permute import apply_permutation, random_permutation
from mergeflow.align.spec import AxisRef, PermGroup, PermutationSpec, Probe

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CHANNEL_NORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)
_LAST_AXIS_NORMS = tuple(c for c in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if c is not None)


class _Call(NamedTuple):
    name: str
    module: nn.Module
    inp: torch.Size | None
    out: torch.Size | None


@dataclass
class _Group:
    size: int
    axes: list[AxisRef] = field(default_factory=list)
    probe: Probe | None = None


@dataclass
class _Cursor:
    """The open group: its index and where its units sit in the current activation."""

    group: int
    axis: int
    block: int = 1


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def _dummy(model: nn.Module, input_shape: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = dtype or (first.dtype if first is not None else torch.float32)
    gen = torch.Generator().manual_seed(0)
    shape = (3, *[int(d) for d in input_shape])
    return torch.randn(shape, generator=gen, dtype=torch.float64, device=gen.device).to(device, dtype)


def _trace(model: nn.Module, input_shape: Sequence[int]) -> list[_Call]:
    for name, module in model.named_modules():
        if any(True for _ in module.children()) and _has_state(module):
            raise ValueError(
                f"module {name or type(module).__name__!r} holds its own parameters besides submodules; "
                "permutation_spec only handles chains of plain layers"
            )
    calls: list[_Call] = []

    def hook(name: str):
        def record(module: nn.Module, args: tuple, output) -> None:
            inp = args[0].shape if args and isinstance(args[0], torch.Tensor) else None
            out = output.shape if isinstance(output, torch.Tensor) else None
            calls.append(_Call(name, module, inp, out))

        return record

    leaves = [(n, m) for n, m in model.named_modules() if not any(True for _ in m.children())]
    handles = [m.register_forward_hook(hook(n)) for n, m in leaves]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(_dummy(model, input_shape))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    names = [c.name for c in calls]
    if len(set(names)) != len(names):
        raise ValueError("a module is called more than once (shared weights); permutation_spec needs a plain chain")
    return calls


class _Walker:
    def __init__(self) -> None:
        self.groups: list[_Group] = []
        self.dropped: set[int] = set()
        self.cur: _Cursor | None = None

    def drop(self, why: str | None = None) -> None:
        """Leave the open group unpermuted."""
        if self.cur is None:
            return
        if why:
            warnings.warn(f"{self.groups[self.cur.group].size} hidden units left unpermuted: {why}", stacklevel=4)
        self.dropped.add(self.cur.group)
        self.cur = None

    def add(self, prefix: str, module: nn.Module, attrs: Sequence[str], axis: int) -> None:
        assert self.cur is not None
        for attr in attrs:
            if getattr(module, attr, None) is not None:
                self.groups[self.cur.group].axes.append(AxisRef(prefix + attr, axis, self.cur.block))

    def open(self, prefix: str, module: nn.Module, size: int, axis: int) -> None:
        self.groups.append(_Group(size))
        self.cur = _Cursor(len(self.groups) - 1, axis)
        self.add(prefix, module, ("weight", "bias"), 0)

    def step(self, call: _Call, prev_out: torch.Size | None) -> None:
        name, m, inp, out = call
        prefix = f"{name}." if name else ""
        what = f"{type(m).__name__} {name!r}"
        if self.cur is not None and (inp is None or inp != prev_out):
            self.drop(f"the input of {what} is not the previous layer's output")
        cur = self.cur
        if isinstance(m, nn.Linear) or (isinstance(m, _CONVS) and m.groups == 1):
            unit_axis = len(inp) - 1 if isinstance(m, nn.Linear) else 1
            if cur is not None and cur.axis == unit_axis and (cur.block == 1 or isinstance(m, nn.Linear)):
                self.add(prefix, m, ("weight",), 1)
            else:
                self.drop(f"{what} does not consume them along its input axis")
            size = m.out_features if isinstance(m, nn.Linear) else m.out_channels
            self.open(prefix, m, size, len(out) - 1 if isinstance(m, nn.Linear) else 1)
        elif isinstance(m, _CHANNEL_NORMS):
            if cur is not None and cur.axis == 1:
                self.add(prefix, m, ("weight", "bias", "running_mean", "running_var"), 0)
        elif isinstance(m, _LAST_AXIS_NORMS):
            first = len(inp) - len(m.normalized_shape)
            if cur is not None and cur.axis >= first:
                self.add(prefix, m, ("weight", "bias"), cur.axis - first)
        elif isinstance(m, nn.GroupNorm):
            if cur is not None and cur.axis == 1:
                per_group = m.num_channels // m.num_groups
                if m.num_groups == 1 or cur.block % per_group == 0:
                    self.add(prefix, m, ("weight", "bias"), 0)
                else:
                    self.drop(f"{what} has groups of {per_group} channels, which permutations would mix")
        elif isinstance(m, nn.PReLU):
            if cur is not None and cur.axis == 1 and m.num_parameters > 1:
                self.add(prefix, m, ("weight",), 0)
        elif isinstance(m, nn.Flatten):
            if cur is not None:
                start, end = m.start_dim % len(inp), m.end_dim % len(inp)
                if cur.axis > end:
                    cur.axis -= end - start
                elif cur.axis >= start:
                    if any(inp[d] != 1 for d in range(start, cur.axis)):
                        self.drop(f"{what} interleaves them with other dimensions")
                    else:
                        cur.block *= math.prod(inp[cur.axis + 1 : end + 1])
                        cur.axis = start
        elif _has_state(m):
            self.drop(f"{what} is not a supported layer")
        elif cur is not None and (out is None or len(out) != len(inp) or out[cur.axis] != inp[cur.axis]):
            self.drop(f"{what} changes the unit axis")
        if self.cur is not None:
            self.groups[self.cur.group].probe = Probe(name, self.cur.axis, self.cur.block)

    def spec(self) -> PermutationSpec:
        kept = [g for i, g in enumerate(self.groups) if i not in self.dropped]
        return PermutationSpec({f"P_{i}": PermGroup(g.size, tuple(g.axes), g.probe) for i, g in enumerate(kept)})


def permutation_spec(model: nn.Module, input_shape: Sequence[int], *, check: bool = True) -> PermutationSpec:
    """Derive the hidden-unit permutation groups of a chain-structured model.

    Handles ``nn.Sequential``-style MLPs and CNNs (Linear, Conv1d/2d/3d with ``groups=1``,
    BatchNorm/InstanceNorm/LayerNorm/RMSNorm/GroupNorm, PReLU, Flatten and any parameter-free
    module that keeps the unit axis); no spec needs to be written. The input and the output
    units are never permuted.

    Args:
        model: the model; it is traced once in eval mode on a dummy batch (its mode is restored).
        input_shape: shape of one example, e.g. ``[64]`` or ``[1, 8, 8]``.
        check: verify in float64 that a random permutation from the spec leaves the outputs
            unchanged (catches residual connections and other non-chain structure).

    Returns:
        The spec, groups named ``P_0, P_1, ...`` in forward order.

    Raises:
        ValueError: on shared modules, modules with parameters besides children, or a failed check.
    """
    calls = _trace(model, input_shape)
    walker = _Walker()
    prev_out = None
    for call in calls:
        walker.step(call, prev_out)
        prev_out = call.out
    walker.drop()  # the output units are never permuted
    spec = walker.spec()
    if check:
        verify_spec(model, spec, input_shape)
    return spec


def verify_spec(model: nn.Module, spec: PermutationSpec, input_shape: Sequence[int], *, seed: int = 0) -> None:
    """Raise ``ValueError`` unless a random permutation from ``spec`` keeps ``model``'s outputs
    (in eval mode, float64, on a random batch of ``input_shape`` examples)."""
    if not spec.groups:
        return
    probe = copy.deepcopy(model).to(torch.float64).eval()
    state = probe.state_dict()
    missing = [key for key in spec.keys() if key not in state]
    if missing:
        raise ValueError(f"spec keys not in the model's state dict: {missing}")
    x = _dummy(probe, input_shape, torch.float64)
    with torch.no_grad():
        before = probe(x)
        probe.load_state_dict(apply_permutation(spec, state, random_permutation(spec, seed)))
        after = probe(x)
    scale = float(before.abs().max()) + 1.0
    if not torch.allclose(after, before, rtol=1e-7, atol=1e-9 * scale):
        raise ValueError(
            "permuting the derived groups changes the model's outputs: the model is not a plain chain of "
            "layers (residual connections, attention, or functional ops that mix units?)"
        )
