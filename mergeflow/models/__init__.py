"""Models: one family per module, each named by its declaration (:mod:`mergeflow.schema.families`):
plain ``nn.Sequential`` MLPs/CNNs (:mod:`~mergeflow.models.sequential`) and Hugging Face transformers
(:mod:`~mergeflow.models.hf`, which imports ``transformers`` only when it builds one).

Every checkpoint carries a JSON spec; :func:`build_from_spec` rebuilds its architecture through the
family of its ``arch``, importing that family's module only, so the trainers, Fishers, merges and
federated rounds never ask which one it is.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from mergeflow.models.family import ModelFamily, family_of


def build_from_spec(spec: dict[str, Any]) -> nn.Module:
    """Build the model a spec describes, whatever its family."""
    return family_of(spec["arch"]).from_spec(spec)


def parameter_names(spec: dict[str, Any]) -> list[str]:
    """The parameter names of a spec's model in ``named_parameters`` order.

    Flattened vectors and Fisher factor columns follow this order; safetensors files list
    tensors alphabetically (``"10.weight"`` before ``"2.weight"``), so use it, not file order.
    """
    return [name for name, _ in build_from_spec(spec).named_parameters()]


def count_parameters(model: nn.Module) -> int:
    """Total number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["ModelFamily", "build_from_spec", "count_parameters", "family_of", "parameter_names"]
