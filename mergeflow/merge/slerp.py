"""SLERP: spherical linear interpolation of two models, tensor by tensor."""

from __future__ import annotations

import math

import torch

from mergeflow.errors import MergeflowError
from mergeflow.merge.engine import TensorInputs
from mergeflow.schema.merge import SlerpOptions

# Directions closer than this (|cos| above it) are interpolated linearly, as mergekit does.
PARALLEL = 0.9995


def slerp_coefficients(gram: torch.Tensor, t: float) -> tuple[float, float]:
    """(sin((1−t)θ)/sin θ, sin(tθ)/sin θ) for two vectors with Gram matrix ``gram``, θ their angle;
    (1 − t, t) when they are nearly parallel."""
    norms = math.sqrt(max(float(gram[0, 0]) * float(gram[1, 1]), 0.0))
    cos = float(gram[0, 1]) / norms if norms > 0 else 1.0
    if abs(cos) > PARALLEL:
        return 1 - t, t
    theta = math.acos(cos)
    return math.sin((1 - t) * theta) / math.sin(theta), math.sin(t * theta) / math.sin(theta)


def slerp(x: TensorInputs, options: SlerpOptions) -> torch.Tensor:
    """SLERP of exactly two models per tensor at t (K ≠ 2 is refused; `karcher` merges K ≥ 2 on the sphere)."""
    if len(x.tensors) != 2:
        raise MergeflowError(f"slerp merges exactly two models, got {len(x.tensors)}")
    assert x.gram is not None  # guaranteed by gram=
    first, second = slerp_coefficients(x.gram, options.t)
    return first * x.tensors[0] + second * x.tensors[1]
