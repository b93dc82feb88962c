"""Models: plain ``nn.Sequential`` MLPs/CNNs and Hugging Face transformers, one module per family.

Every checkpoint carries a JSON spec; :func:`build_from_spec` rebuilds its architecture whatever
the family, so the trainers, Fishers, merges and federated rounds never ask which one it is.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from mergeflow.models.sequential import ARCHITECTURES, DEFAULT_CNN_HIDDEN, build_model, model_spec
from mergeflow.models.sequential import build_sequential_from_spec as _build_sequential


def build_from_spec(spec: dict[str, Any]) -> nn.Module:
    """Build the model a spec describes (``arch: hf`` or one of :data:`ARCHITECTURES`)."""
    if spec["arch"] == "hf":
        from mergeflow.models.hf import build_from_hf_spec

        return build_from_hf_spec(spec)
    return _build_sequential(spec)


def is_transformer(spec: dict[str, Any]) -> bool:
    """Whether a spec is a Hugging Face transformers model."""
    return spec["arch"] == "hf"


def parameter_names(spec: dict[str, Any]) -> list[str]:
    """The parameter names of a spec's model in ``named_parameters`` order.

    Flattened vectors and Fisher factor columns follow this order; safetensors files list
    tensors alphabetically (``"10.weight"`` before ``"2.weight"``), so use it, not file order.
    """
    return [name for name, _ in build_from_spec(spec).named_parameters()]


def count_parameters(model: nn.Module) -> int:
    """Total number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "ARCHITECTURES",
    "DEFAULT_CNN_HIDDEN",
    "build_from_spec",
    "build_model",
    "count_parameters",
    "is_transformer",
    "model_spec",
    "parameter_names",
]
