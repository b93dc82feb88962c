"""A PEFT LoRA adapter folded into full weights, from its saved tensors and ``adapter_config.json`` alone.

Each targeted module's weight becomes W0 + s·B·A, with s = alpha / r (alpha / sqrt(r) with ``use_rslora``), r and
alpha per module from ``rank_pattern`` and ``alpha_pattern`` (a pattern matches a module whose name ends in it, at a
dot); ``fan_in_fan_out`` modules (GPT-2's ``Conv1D``) and embeddings take the transpose, (B·A)ᵀ. A LoRA bias
(``lora_bias``) adds s·b_B to the module's bias. Tensors saved beside the adapters (``modules_to_save``, and the
biases that ``bias: all`` or ``lora_only`` trained) replace the base's. The result has exactly the base's names,
as PEFT's ``merge_and_unload`` leaves them. Names are the adapted model's own (``bert.encoder…``), without PEFT's
``base_model.model.`` prefix.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

_PEFT_PREFIX = "base_model.model."
_FACTORS = (
    (re.compile(r"(.+)\.lora_A\.weight"), "A"),
    (re.compile(r"(.+)\.lora_B\.weight"), "B"),
    (re.compile(r"(.+)\.lora_B\.bias"), "bias"),
    (re.compile(r"(.+)\.lora_embedding_A"), "embedding_A"),
    (re.compile(r"(.+)\.lora_embedding_B"), "embedding_B"),
)
_BASE_LAYER = re.compile(r"(.+)\.base_layer\.(\w+)")


def fold_lora(
    base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """The base's weights with the adapter folded in (see the module's docstring); the base is left unchanged.

    Args:
        base: the base model's tensors by name.
        adapter: the tensors of ``adapter_model.safetensors``.
        config: ``adapter_config.json``.

    Raises:
        ValueError: an adapter tensor this fold does not know (DoRA's magnitudes, …), or one whose module or shape
            the base does not have.
    """
    factors, replaced = _parse(adapter)
    folded = dict(base)
    for name, value in replaced.items():
        _check_shape(name, value, base)
        folded[name] = value.to(base[name].dtype)
    for module, parts in factors.items():
        embedding = "embedding_A" in parts
        a, b = (parts["embedding_A"], parts["embedding_B"]) if embedding else (parts.get("A"), parts.get("B"))
        if a is None or b is None:
            raise ValueError(f"{module}: the adapter holds only one of its two LoRA factors")
        rank = _per_module(config.get("rank_pattern"), module, config["r"])
        if a.shape[0] != rank:
            raise ValueError(f"{module}: its LoRA A has rank {a.shape[0]}, and the adapter's config says {rank}")
        alpha = _per_module(config.get("alpha_pattern"), module, config["lora_alpha"])
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        weight = f"{module}.weight"
        if weight not in base:
            raise ValueError(f"the adapter targets {module}, which the base model does not have")
        delta = _product(b, a)
        if embedding or config.get("fan_in_fan_out"):
            delta = delta.T
        delta = delta * scale
        _check_shape(weight, delta, base)
        folded[weight] = base[weight] + delta.to(base[weight].dtype)
        if "bias" in parts:
            bias = f"{module}.bias"
            if bias not in base:
                raise ValueError(f"{module}: the adapter has a LoRA bias, and the base module has no bias")
            folded[bias] = folded[bias] + (parts["bias"] * scale).to(base[bias].dtype)
    return folded


def touched(adapter: Mapping[str, torch.Tensor]) -> set[str]:
    """The names of the base's tensors that the adapter changes or replaces."""
    factors, replaced = _parse(adapter)
    return {f"{module}.weight" for module in factors} | set(replaced)


def _parse(adapter: Mapping[str, torch.Tensor]) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The LoRA factors by module, and the tensors that replace the base's, by the base's names."""
    factors: dict[str, dict[str, torch.Tensor]] = {}
    replaced: dict[str, torch.Tensor] = {}
    for key, value in adapter.items():
        name = key.removeprefix(_PEFT_PREFIX)
        found = next(((match[1], part) for pattern, part in _FACTORS if (match := pattern.fullmatch(name))), None)
        if found is not None:
            factors.setdefault(found[0], {})[found[1]] = value
        elif layer := _BASE_LAYER.fullmatch(name):
            replaced[f"{layer[1]}.{layer[2]}"] = value
        elif "lora_" in name:
            raise ValueError(f"{key}: an adapter tensor that plain LoRA does not have (DoRA, a variant?)")
        else:
            replaced[name] = value
    return factors, replaced


def _per_module(patterns: Mapping[str, Any] | None, module: str, default: Any) -> Any:
    """The value of the first pattern that ``module``'s name ends in (at a dot boundary), else ``default``."""
    for pattern, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            return value
    return default


def _product(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """B·A, in float32 for half-precision factors (as PEFT computes it on the CPU)."""
    if b.dtype in (torch.float16, torch.bfloat16):
        return b.float() @ a.float()
    return b @ a


def _check_shape(name: str, value: torch.Tensor, base: Mapping[str, torch.Tensor]) -> None:
    if name not in base:
        raise ValueError(f"the adapter holds {name}, which the base model does not have")
    if value.shape != base[name].shape:
        raise ValueError(f"{name}: the adapter's is {tuple(value.shape)}, the base model's {tuple(base[name].shape)}")
