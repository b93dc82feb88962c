"""SLERP: spherical linear interpolation of two models, tensor by tensor."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from mergeflow.errors import MergeflowError
from mergeflow.merge.registry import TensorInputs, merge_method

# Directions closer than this (|cos| above it) are interpolated linearly, as mergekit does.
PARALLEL = 0.9995


class SlerpOptions(BaseModel):
    """``t``: 0 gives the first model, 1 the second."""

    model_config = ConfigDict(extra="forbid")
    t: float = Field(0.5, ge=0, le=1)


def slerp_pair(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    """sin((1−t)θ)/sin θ · a + sin(tθ)/sin θ · b, θ the angle between ``a`` and ``b`` (linear when nearly parallel)."""
    norms = a.norm() * b.norm()
    cos = float((a * b).sum() / norms) if norms > 0 else 1.0
    if abs(cos) > PARALLEL:
        return (1 - t) * a + t * b
    theta = torch.arccos(torch.tensor(cos, dtype=torch.float64))
    return (torch.sin((1 - t) * theta) * a + torch.sin(t * theta) * b) / torch.sin(theta)


@merge_method("slerp", options=SlerpOptions)
def slerp(x: TensorInputs, options: SlerpOptions) -> torch.Tensor:
    """SLERP of exactly two models per tensor at t (K > 2 is refused: no single rule is standard)."""
    if len(x.tensors) != 2:
        raise MergeflowError(f"slerp merges exactly two models, got {len(x.tensors)}")
    return slerp_pair(x.tensors[0], x.tensors[1], options.t)
