"""Aligning hidden units across models before merging: permutation specs derived from the
model, weight matching (Git Re-Basin), activation matching, and the loss barrier.

Library code only (no Prefect, no MLflow)::

    spec = permutation_spec(model, input_shape)
    result = weight_matching(spec, reference_state, other_state, seed=0)
    aligned = apply_permutation(spec, other_state, result.perms)
"""

from mergeflow.align.barrier import (
    BarrierResult,
    interpolate,
    loss_barrier,
    make_loss_fn,
    make_metric_fn,
)
from mergeflow.align.matching import (
    MatchResult,
    activation_matching,
    align_models,
    weight_matching,
    weight_objective,
)
from mergeflow.align.permute import (
    apply_permutation,
    compose_permutations,
    flat_column_index,
    invert_permutation,
    permute_flat_columns,
    permute_grams,
    permute_tensor,
    random_permutation,
)
from mergeflow.align.repair import RepairPoint, goal_statistics, repair, repair_points, unit_statistics
from mergeflow.align.spec import AxisRef, PermGroup, PermutationSpec, Probe
from mergeflow.align.trace import permutation_spec, verify_spec

__all__ = [
    "AxisRef",
    "BarrierResult",
    "MatchResult",
    "PermGroup",
    "PermutationSpec",
    "Probe",
    "RepairPoint",
    "activation_matching",
    "align_models",
    "apply_permutation",
    "compose_permutations",
    "flat_column_index",
    "goal_statistics",
    "interpolate",
    "invert_permutation",
    "loss_barrier",
    "make_metric_fn",
    "make_loss_fn",
    "permutation_spec",
    "permute_flat_columns",
    "permute_grams",
    "permute_tensor",
    "random_permutation",
    "repair",
    "repair_points",
    "unit_statistics",
    "verify_spec",
    "weight_matching",
    "weight_objective",
]
