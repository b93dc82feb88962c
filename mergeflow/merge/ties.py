"""TIES-merging (Yadav et al. 2023): trim, elect sign, disjoint merge."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from mergeflow.merge.registry import TensorInputs, merge_method
from mergeflow.merge.sparsify import disjoint_mean, trim_by_magnitude


class TiesOptions(BaseModel):
    """``density``: the fraction of each task vector kept (top magnitudes, per tensor as in PEFT and
    mergekit; the paper's k = 20%); ``scaling``: λ on the merged task vector."""

    model_config = ConfigDict(extra="forbid")
    density: float = Field(0.2, gt=0, le=1)
    scaling: float = 1.0


@merge_method("ties", options=TiesOptions, needs=("base",))
def ties(x: TensorInputs, options: TiesOptions) -> torch.Tensor:
    """TIES: base + λ · disjoint mean of the trimmed, sign-elected task vectors."""
    assert x.base is not None  # guaranteed by needs=("base",)
    tasks = trim_by_magnitude(x.stacked() - x.base, options.density)
    return x.base + options.scaling * disjoint_mean(tasks)
