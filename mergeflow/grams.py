"""Gram matrices XᵀX of the inputs of every linear layer, the per-client statistic RegMean merges with."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mergeflow.training import as_inputs


def linear_input_grams(
    model: nn.Module, X: np.ndarray | torch.Tensor, *, batch_size: int = 256
) -> dict[str, torch.Tensor]:
    """Σ xxᵀ over the inputs x of every ``nn.Linear`` (each position of a sequence is a row), float64,
    keyed by the layer's weight name. The model runs in eval mode without gradients."""
    grams: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            key = f"{name}.weight" if name else "weight"

            def accumulate(_module: nn.Module, inputs: tuple, _output: torch.Tensor, key: str = key) -> None:
                rows = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(torch.float64)
                grams[key] = grams[key] + rows.T @ rows if key in grams else rows.T @ rows

            hooks.append(module.register_forward_hook(accumulate))
    inputs = as_inputs(X, dtype=next(model.parameters()).dtype)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(inputs), batch_size):
                model(inputs[start : start + batch_size])
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return grams
