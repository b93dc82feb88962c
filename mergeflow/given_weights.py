"""A given model (:mod:`mergeflow.given`) read into this project's format: its spec and a state dict with exactly the
run's base model's names and shapes, so that merges, Fishers and evaluation treat it like a model trained here.

A mergeflow checkpoint keeps its own spec. A Hugging Face directory and a LoRA adapter take the base's spec: their
tensors are named as the wrapped model names them, which the base's names hold below one prefix (a
:class:`~mergeflow.models.token_model.TokenModel`'s ``model.``), found from the names themselves; an adapter is
folded onto the base's weights (:func:`mergeflow.lora_fold.fold_lora`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mergeflow.checkpoints import load_checkpoint
from mergeflow.errors import MergeflowError
from mergeflow.given import ADAPTER_WEIGHTS, HF_DIRECTORY, MERGEFLOW, PEFT_LORA, Given, adapter_config, common_prefix
from mergeflow.hf_checkpoints import open_checkpoint
from mergeflow.lora_fold import fold_lora, touched

State = dict[str, torch.Tensor]


def read_given(given: Given, base: Mapping[str, torch.Tensor], base_spec: dict[str, Any]) -> tuple[dict, State]:
    """The spec and weights of a given model, checked against the run's base model (``base``, ``base_spec``).

    Raises:
        ValueError: why it cannot stand beside the base: a head for another number of classes, other parameter
            names or shapes, an adapter that does not fit the base.
    """
    if given.kind == MERGEFLOW:
        try:
            state, meta = load_checkpoint(given.path)
        except MergeflowError as error:
            raise ValueError(str(error)) from None
        spec = meta.get("spec") or {}
        _check_outputs(spec.get("output_dim"), base_spec)
    elif given.kind == HF_DIRECTORY:
        state, spec = _renamed(_read_all(given), base), base_spec
    elif given.kind == PEFT_LORA:
        state, spec = _folded(given, base), base_spec
    else:
        raise ValueError(f"unknown kind {given.kind!r}")
    check_like(state, base)
    return spec, state


def _read_all(given: Given, path=None) -> State:
    """Every tensor of a safetensors file or model directory."""
    try:
        checkpoint = open_checkpoint(path or given.path)
    except MergeflowError as error:
        raise ValueError(str(error)) from None
    try:
        return {key: checkpoint[key] for key in checkpoint}
    finally:
        checkpoint.close()


def _folded(given: Given, base: Mapping[str, torch.Tensor]) -> State:
    """An adapter folded onto the base, under the base's names."""
    adapter = _read_all(given, given.path / ADAPTER_WEIGHTS)
    prefix = common_prefix(base, touched(adapter))
    theirs = {key.removeprefix(prefix): value for key, value in base.items()}
    return {prefix + key: value for key, value in fold_lora(theirs, adapter, adapter_config(given.path)).items()}


def _renamed(state: State, base: Mapping[str, torch.Tensor]) -> State:
    """A model directory's tensors under the base's names (its own names below the base's common prefix), in the
    base's dtypes."""
    prefix = common_prefix(base, state)
    renamed = {prefix + key: value for key, value in state.items()}
    return {key: value.to(base[key].dtype) if key in base else value for key, value in renamed.items()}


def _check_outputs(outputs: int | None, base_spec: dict[str, Any]) -> None:
    expected = base_spec.get("output_dim")
    if outputs is not None and expected is not None and outputs != expected:
        raise ValueError(f"its head has {outputs} outputs, and the base model's (the data's) {expected}")


def check_like(state: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> None:
    """Raise ValueError unless ``state`` has exactly ``base``'s parameter names and shapes."""
    missing = [key for key in base if key not in state]
    unknown = [key for key in state if key not in base]
    if missing or unknown:
        parts = [
            f"{len(names)} {what} ({names[0]}, …)"
            for what, names in (("missing", missing), ("unknown", unknown))
            if names
        ]
        raise ValueError(f"its parameter names are not the base model's: {', '.join(parts)}; another architecture?")
    for key, value in state.items():
        if value.shape != base[key].shape:
            raise ValueError(
                f"{key} has shape {tuple(value.shape)}, the base model's {tuple(base[key].shape)}: "
                "another architecture?"
            )
