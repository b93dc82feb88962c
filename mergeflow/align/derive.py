"""The permutation spec of a checkpoint's model, whatever its family: each family that aligns names the
function that derives it in its declaration (``permutation_spec``, :mod:`mergeflow.schema.families`).

The families' own modules do not import the alignment code (their steps' cache keys would then follow
it): the built-in families' derivations live here.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from mergeflow.align.spec import PermutationSpec
from mergeflow.align.trace import permutation_spec
from mergeflow.align.transformer_spec import transformer_spec
from mergeflow.registry import imported
from mergeflow.schema.families import family_of_arch


def traced_spec(model: nn.Module, spec: dict[str, Any]) -> PermutationSpec:
    """The spec of a plain ``nn.Sequential``, traced through one input of the spec's ``input_shape``."""
    return permutation_spec(model, spec["input_shape"])


def transformers_spec(model: nn.Module, spec: dict[str, Any]) -> PermutationSpec:
    """The spec of a BERT- or GPT-2-style transformer (MLP units, whole attention heads, the residual stream)."""
    return transformer_spec(model)


def model_permutation_spec(model: nn.Module, spec: dict[str, Any]) -> PermutationSpec:
    """The checked permutation spec of ``model``, built from the checkpoint spec ``spec`` (its ``arch``
    names the family).

    Raises:
        ValueError: when the family does not align, or the model has no spec (a transformers model type
            without one).
    """
    family = family_of_arch(spec["arch"])
    if family.permutation_spec is None:
        raise ValueError(f"model family {family.name!r} has no permutation spec: alignment does not apply to it")
    return imported(family.permutation_spec, owner=f"model family {family.name!r}")(model, spec)
