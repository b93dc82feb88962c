"""LoRA adapters out of a merged transformer: its difference from the base as a PEFT adapter.

Each weight matrix that changed (``nn.Linear``, or transformers' ``Conv1D`` as GPT-2 stores them)
becomes a LoRA pair from a truncated SVD of its difference, ΔW ≈ U_r S_r V_rᵀ, with
``lora_B = U_r √S_r`` and ``lora_A = √S_r V_rᵀ``. Every module gets its own rank (PEFT's
``rank_pattern``) and ``lora_alpha`` equal to it, so PEFT's scaling α/r is 1 and ``B·A`` is the
truncation itself. By Eckart–Young it is the best rank-r approximation of ΔW, and at full rank the
adapter reproduces the merged weights to rounding.

What a LoRA pair cannot hold is stored whole (PEFT's ``modules_to_save``): the task head (outside
the base model: new and small), the changed modules of any other kind (LayerNorms, embeddings),
and, for GPT-2-style models whose projections are ``Conv1D`` (PEFT's ``fan_in_fan_out``, one
setting per adapter), the changed ``nn.Linear`` modules too. The biases of the LoRA modules travel
as PEFT's ``bias="lora_only"``.

This is mergekit's ``mergekit-extract-lora`` (a per-module SVD written as a PEFT adapter with a
``rank_pattern``) for mergeflow's merged models. Its difference: mergekit can also factor embeddings;
here they are stored whole.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn


class AdapterRankError(ValueError):
    """A requested rank no module can hold (larger than the smaller side of its weight)."""


@dataclass
class ExtractedAdapter:
    """A PEFT model over a copy of the base, holding the adapter (``save_pretrained`` writes it), and a report.

    ``ranks`` gives each LoRA module's rank, ``errors`` the relative Frobenius error of its truncation
    ‖ΔW − B·A‖ / ‖ΔW‖, and ``saved`` the modules stored whole.
    """

    model: nn.Module
    ranks: dict[str, int] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    saved: list[str] = field(default_factory=list)


def _is_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def _delta_matrix(module: nn.Module, merged_weight: torch.Tensor) -> torch.Tensor:
    """ΔW as an ``(out, in)`` matrix in float64 (``Conv1D`` stores its weight ``(in, out)``)."""
    delta = merged_weight.to(torch.float64) - module.weight.detach().to(torch.float64)
    return delta.T if _is_conv1d(module) else delta


def _rank_for(singular: torch.Tensor, rank: int | None, energy: float | None) -> int:
    """The kept rank: ``rank`` as given, or the fewest singular values holding ``energy`` of ΣS²."""
    if rank is not None:
        return rank
    assert energy is not None
    share = torch.cumsum(singular**2, 0) / torch.sum(singular**2)
    wanted = torch.tensor(energy, dtype=share.dtype, device=share.device)
    return min(int(torch.searchsorted(share, wanted).item()) + 1, len(singular))  # 1.0 may round above the sum


def _merged_values(base: nn.Module, merged: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``merged`` under every module's own parameter names: a tied weight (GPT-2's ``lm_head`` is ``wte``)
    appears once in a state dict, under its first name."""
    first = {id(value): name for name, value in base.named_parameters()}
    return {
        f"{module_name}.{p}" if module_name else p: merged[first[id(value)]]
        for module_name, module in base.named_modules()
        for p, value in module.named_parameters(recurse=False)
    }


def _changed(module: nn.Module, name: str, merged: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of ``module``'s own parameters whose merged value differs from the base's."""
    return [
        p
        for p, value in module.named_parameters(recurse=False)
        if not torch.equal(value.detach(), merged[f"{name}.{p}" if name else p].to(value.dtype))
    ]


def extract_lora(
    base: nn.Module,
    merged: Mapping[str, torch.Tensor],
    *,
    rank: int | None = None,
    energy: float | None = None,
) -> ExtractedAdapter:
    """The adapter that turns ``base`` (a transformers ``PreTrainedModel``) into the model with state ``merged``.

    Args:
        base: the base model (left unchanged: the adapter wraps a copy).
        merged: the merged model's state dict, under the base's parameter names.
        rank: each LoRA module's rank; None with ``energy``.
        energy: in (0, 1]: each module keeps the fewest singular values whose squares hold this share.

    Raises:
        AdapterRankError: ``rank`` exceeds a module's smaller side.
    """
    from peft import LoraConfig, get_peft_model

    if (rank is None) == (energy is None):
        raise ValueError("give one of rank and energy")
    modules = dict(base.named_modules())
    merged = _merged_values(base, merged)
    changed = {name: found for name, module in modules.items() if (found := _changed(module, name, merged))}
    conv = any(_is_conv1d(modules[name]) for name in changed)
    lora_kind = _is_conv1d if conv else (lambda m: isinstance(m, nn.Linear))
    body = f"{base.base_model_prefix}."  # a task head (new, small) is stored whole
    targets = [n for n in changed if n.startswith(body) and lora_kind(modules[n]) and "weight" in changed[n]]
    saved = [n for n in changed if n not in targets]
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    report = ExtractedAdapter(model=base, saved=saved)
    for name in targets:
        module = modules[name]
        delta = _delta_matrix(module, merged[f"{name}.weight"])
        if rank is not None and rank > min(delta.shape):
            shape = tuple(delta.shape)
            raise AdapterRankError(f"rank {rank} is larger than module {name}'s {min(shape)} ({shape})")
        u, s, vh = torch.linalg.svd(delta, full_matrices=False)
        kept = _rank_for(s, rank, energy)
        root = s[:kept].sqrt()
        b, a = u[:, :kept] * root, root[:, None] * vh[:kept]
        report.ranks[name] = kept
        report.errors[name] = float(torch.linalg.norm(delta - b @ a) / torch.linalg.norm(delta))
        factors[name] = (a, b)
    config = LoraConfig(
        r=max(report.ranks.values(), default=1),
        lora_alpha=max(report.ranks.values(), default=1),
        target_modules=targets,
        modules_to_save=saved or None,
        rank_pattern=dict(report.ranks),
        alpha_pattern=dict(report.ranks),
        fan_in_fan_out=conv,
        bias="lora_only",
        lora_dropout=0.0,
        ensure_weight_tying=bool(getattr(base.config, "tie_word_embeddings", False)),
    )
    model = get_peft_model(copy.deepcopy(base), config)
    _fill(model, factors, saved, merged, changed)
    report.model = model.eval()
    return report


def _fill(
    model: nn.Module,
    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    saved: list[str],
    merged: Mapping[str, torch.Tensor],
    changed: Mapping[str, list[str]],
) -> None:
    """Put the LoRA factors, the LoRA modules' merged biases and the saved modules' merged values in ``model``."""
    inner = model.base_model.model
    with torch.no_grad():
        for name, (a, b) in factors.items():
            layer = inner.get_submodule(name)
            layer.lora_A["default"].weight.copy_(a)
            layer.lora_B["default"].weight.copy_(b)
            if "bias" in changed[name]:
                layer.base_layer.bias.copy_(merged[f"{name}.bias"])
        for name in saved:
            copy_of = inner.get_submodule(name).modules_to_save["default"]
            for p, value in copy_of.named_parameters(recurse=False):
                value.copy_(merged[f"{name}.{p}"])
