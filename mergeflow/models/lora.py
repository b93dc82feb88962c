"""LoRA fine-tuning of a :class:`~mergeflow.models.hf.TokenModel` through ``peft``, folded back.

A client trains low-rank adapters (W + B·A on the target modules) and the classification head; its
update is then folded into full weights (``merge_and_unload``), so the checkpoint has exactly the
base model's keys and every merge method combines the clients' updates B_k·A_k. Averaging the A and
B factors separately would not: mean(B)·mean(A) ≠ mean(B·A).

The head is made trainable explicitly, not through ``task_type="SEQ_CLS"``: that puts it in
``modules_to_save``, which breaks ``add_weighted_adapter`` and keeps a second copy of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from mergeflow.models.hf import auto_class, head_names, seeded
from mergeflow.models.token_model import TokenModel


def unmatched_targets(model: nn.Module, target_modules: list[str]) -> list[str]:
    """The entries of ``target_modules`` that name no module of ``model`` (peft matches name suffixes)."""
    names = [name for name, _ in model.named_modules()]
    return [t for t in target_modules if not any(n == t or n.endswith(f".{t}") for n in names)]


def missing_modules(
    pretrained: str | None, config: dict[str, Any], target_modules: list[str], task: str = "sequence_classification"
) -> list[str]:
    """The LoRA targets that name no module of the model ``pretrained``/``config`` describe.

    The architecture is built on the meta device (no weights, no memory), so this is cheap enough
    to run while the params are validated, before any work.
    """
    from transformers import AutoConfig

    overrides = {k: v for k, v in config.items() if k != "model_type"}
    if pretrained:
        hf_config = AutoConfig.from_pretrained(pretrained, **overrides)
    else:
        hf_config = AutoConfig.for_model(config["model_type"], **overrides)
    with torch.device("meta"):
        model = auto_class(task).from_config(hf_config)
    return unmatched_targets(model, target_modules)


def attach_adapters(model: TokenModel, settings: dict[str, Any], seed: int) -> TokenModel:
    """Give ``model`` LoRA adapters (in place) and freeze everything but them and the head.

    Args:
        model: the transformer wrapper; its weights stay as they are (B = 0 at the start).
        settings: ``r``, ``alpha``, ``dropout`` and ``target_modules`` (module name suffixes).
        seed: seed of the adapters' init (A is random, B zero, so training starts at the base model).
    """
    from peft import LoraConfig, get_peft_model

    inner = model.model
    config = LoraConfig(
        r=settings["r"],
        lora_alpha=settings["alpha"],
        lora_dropout=settings["dropout"],
        target_modules=list(settings["target_modules"]),
    )
    heads = head_names(inner)
    with seeded(seed):
        wrapped = get_peft_model(inner, config)
    for name, parameter in inner.named_parameters():
        if name in heads:
            parameter.requires_grad_(True)
    model.model = wrapped
    return model


def fold_adapters(model: TokenModel) -> TokenModel:
    """Fold the adapters into the weights (W + B·A), drop them and make every parameter trainable again."""
    model.model = model.model.merge_and_unload()
    for parameter in model.model.parameters():
        parameter.requires_grad_(True)
    return model


@contextmanager
def lora(model: TokenModel, settings: dict[str, Any], seed: int) -> Iterator[TokenModel]:
    """Within the block, ``model`` trains LoRA adapters and its head only; on exit they are folded in
    (see :func:`attach_adapters`; ``model`` is changed in place: its weights become W + B·A)."""
    attach_adapters(model, settings, seed)
    try:
        yield model
    finally:
        fold_adapters(model)


def trainable_count(model: nn.Module) -> int:
    """Parameters that receive gradients."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
