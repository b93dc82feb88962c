"""The merge-method registry: a new method is one small module with one decorated function.

A method is a function over the K clients' copies of one tensor (plus the base model's
copy and the clients' data weights), so the same code merges in-memory state dicts or
tensors streamed one by one from safetensors files.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from mergeflow.errors import ConfigError, MergeflowError

TensorMerge = Callable[..., torch.Tensor]


class NoOptions(BaseModel):
    """Options of a method that takes none."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class MergeMethod:
    """A registered method: its per-tensor function, its options model and the inputs it needs."""

    name: str
    merge_tensor: TensorMerge
    options: type[BaseModel]
    needs: frozenset[str]
    summary: str


METHODS: dict[str, MergeMethod] = {}


def merge_method(
    name: str, *, options: type[BaseModel] = NoOptions, needs: Sequence[str] = ()
) -> Callable[[TensorMerge], TensorMerge]:
    """Register ``fn(tensors, *, base, weights, options) -> tensor`` under ``name``.

    ``needs`` names extra inputs the pipeline must supply: ``"base"`` (the shared base
    model) and/or ``"weights"`` (client data sizes).
    """

    def register(fn: TensorMerge) -> TensorMerge:
        if name in METHODS:
            raise ValueError(f"merge method {name!r} is registered twice")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        METHODS[name] = MergeMethod(name, fn, options, frozenset(needs), summary)
        return fn

    return register


def validate_options(method: str, options: Mapping[str, object]) -> BaseModel:
    """Parse a method's options, raising ConfigError that names the method and key."""
    if method not in METHODS:
        raise ConfigError([f"merge method {method!r} is unknown; known: {', '.join(METHODS)}"])
    try:
        return METHODS[method].options.model_validate(dict(options))
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise ConfigError([f"merge.options.{method}.{key}: {first['msg']}"]) from None


def _check_compatible(states: Sequence[Mapping[str, torch.Tensor]]) -> None:
    reference = states[0]
    for k, state in enumerate(states[1:], start=1):
        if state.keys() != reference.keys():
            missing = sorted(set(reference) ^ set(state))
            raise MergeflowError(f"model {k} has different tensors from model 0: {', '.join(missing[:5])}")
        for key, tensor in state.items():
            if tensor.shape != reference[key].shape:
                raise MergeflowError(
                    f"model {k} tensor {key!r} has shape {tuple(tensor.shape)}, "
                    f"model 0 has {tuple(reference[key].shape)}: the architectures differ"
                )


def normalized_weights(sizes: Sequence[float] | None, count: int) -> torch.Tensor:
    """Client weights n_k/N as float64 (uniform when no sizes are given)."""
    if sizes is None:
        return torch.full((count,), 1.0 / count, dtype=torch.float64)
    if len(sizes) != count:
        raise MergeflowError(f"got {len(sizes)} weights for {count} models")
    w = torch.as_tensor(sizes, dtype=torch.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise MergeflowError("merge weights must be non-negative with a positive sum")
    return w / w.sum()


def merge(
    method: str,
    states: Sequence[Mapping[str, torch.Tensor]],
    *,
    base: Mapping[str, torch.Tensor] | None = None,
    weights: Sequence[float] | None = None,
    **options: object,
) -> dict[str, torch.Tensor]:
    """Merge client state dicts with a registered method.

    Example: ``merge("task_arithmetic", [sd1, sd2], base=sd0, scaling=0.5)``.
    Tensors are combined in float64 and cast back to each tensor's dtype; non-float
    tensors (e.g. counters) are taken from the first model.
    """
    if not states:
        raise MergeflowError("merge needs at least one model")
    spec = METHODS.get(method)
    if spec is None:
        raise MergeflowError(f"unknown merge method {method!r}; known: {', '.join(METHODS)}")
    if "base" in spec.needs and base is None:
        raise MergeflowError(f"merge method {method!r} needs the base model (base=...)")
    parsed = validate_options(method, options)
    _check_compatible([*states, base] if base is not None else states)
    w = normalized_weights(weights, len(states))
    merged = {}
    for key, first in states[0].items():
        if not first.is_floating_point():
            merged[key] = first.clone()
            continue
        tensors = [s[key].to(torch.float64) for s in states]
        base_tensor = base[key].to(torch.float64) if base is not None else None
        out = spec.merge_tensor(tensors, base=base_tensor, weights=w, options=parsed)
        merged[key] = out.to(first.dtype).contiguous()
    return merged
