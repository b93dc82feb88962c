"""The permutation spec of a checkpoint's model, whatever its family: one derivation per family that aligns.

The families' own modules do not import the alignment code (their steps' cache keys would then follow
it); the derivations live here, keyed by the family's name, and every family declared with ``aligns``
(:mod:`mergeflow.schema.families`) has one (a test checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from mergeflow.align.spec import PermutationSpec
from mergeflow.align.trace import permutation_spec
from mergeflow.align.transformer_spec import transformer_spec
from mergeflow.schema.families import family_of_arch

SpecDerivation = Callable[[nn.Module, dict[str, Any]], PermutationSpec]

DERIVATIONS: dict[str, SpecDerivation] = {
    "sequential": lambda model, spec: permutation_spec(model, spec["input_shape"]),
    "transformers": lambda model, spec: transformer_spec(model),
}


def model_permutation_spec(model: nn.Module, spec: dict[str, Any]) -> PermutationSpec:
    """The checked permutation spec of ``model``, built from the checkpoint spec ``spec`` (its ``arch``
    names the family).

    Raises:
        ValueError: when the family has no derivation, or the model none (a transformers model type
            without a spec).
    """
    family = family_of_arch(spec["arch"])
    if family.name not in DERIVATIONS:
        raise ValueError(f"model family {family.name!r} has no permutation spec: alignment does not apply to it")
    return DERIVATIONS[family.name](model, spec)
