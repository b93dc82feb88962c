"""Gram matrices XᵀX of the inputs of every linear layer, the per-client statistic RegMean merges with."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mergeflow import cancel
from mergeflow.device import module_device, to_device
from mergeflow.training import as_inputs

CONV1D = "conv1d:"  # key prefix of a Gram whose layer stores its weight as (inputs, outputs)


def _linear_kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return "linear"
    # transformers' Conv1D, matched by name so that this module never imports transformers
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None and module.weight.dim() == 2:
        return "conv1d"
    return None


def linear_input_grams(
    model: nn.Module, X: np.ndarray | torch.Tensor, *, batch_size: int = 256
) -> dict[str, torch.Tensor]:
    """Σ xxᵀ over the inputs x of every linear layer (each position of a sequence is a row), float64.

    ``nn.Linear`` layers (``y = x Wᵀ``) are keyed by their weight's name; transformers' ``Conv1D``
    (GPT-2's ``y = x W``, the weight stored transposed) by :data:`CONV1D` + the weight's name. A layer
    whose weight is tied to another parameter (GPT-2's ``lm_head``, the token embedding) is left out:
    it is not a linear layer alone. The model runs in eval mode without gradients.
    """
    grams: dict[str, torch.Tensor] = {}
    hooks = []
    own_names = {id(parameter): name for name, parameter in model.named_parameters()}
    for name, module in model.named_modules():
        kind = _linear_kind(module)
        weight_name = f"{name}.weight" if name else "weight"
        if kind is None or own_names.get(id(module.weight)) != weight_name:
            continue
        key = CONV1D + weight_name if kind == "conv1d" else weight_name

        def accumulate(_module: nn.Module, inputs: tuple, _output: torch.Tensor, key: str = key) -> None:
            rows = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(torch.float64)
            grams[key] = grams[key] + rows.T @ rows if key in grams else rows.T @ rows

        hooks.append(module.register_forward_hook(accumulate))
    inputs = as_inputs(X, dtype=next(model.parameters()).dtype)
    device = module_device(model)  # the rows go there a batch at a time
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(inputs), batch_size):
                cancel.check()
                model(to_device(inputs[start : start + batch_size], device))
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return grams
