"""Merge methods checked against closed forms, and the registry's contract."""

from __future__ import annotations

import pytest
import torch

from mergeflow.errors import ConfigError, MergeflowError
from mergeflow.merge import METHODS, merge, merge_method
from mergeflow.merge.registry import METHODS as REGISTRY


def _states(values: list[float]) -> list[dict[str, torch.Tensor]]:
    return [{"w": torch.full((2, 3), v), "b": torch.full((3,), 2 * v), "n": torch.tensor(7)} for v in values]


def test_methods_lists_builtins():
    assert {"average", "weighted", "task_arithmetic"} <= set(METHODS)


def test_average_is_uniform_mean():
    merged = merge("average", _states([1.0, 2.0, 6.0]), weights=[100, 1, 1])
    assert torch.allclose(merged["w"], torch.full((2, 3), 3.0))
    assert torch.allclose(merged["b"], torch.full((3,), 6.0))


def test_weighted_uses_data_sizes():
    merged = merge("weighted", _states([1.0, 4.0]), weights=[3, 1])
    assert torch.allclose(merged["w"], torch.full((2, 3), (3 * 1.0 + 1 * 4.0) / 4))


def test_weighted_without_weights_is_uniform():
    merged = merge("weighted", _states([1.0, 4.0]))
    assert torch.allclose(merged["w"], torch.full((2, 3), 2.5))


def test_task_arithmetic_closed_form():
    base = _states([1.0])[0]
    merged = merge("task_arithmetic", _states([2.0, 4.0]), base=base, scaling=0.5)
    # 1 + 0.5 * ((2-1) + (4-1)) = 3
    assert torch.allclose(merged["w"], torch.full((2, 3), 3.0))


def test_task_arithmetic_with_one_over_k_equals_average():
    base = {"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(0))}
    states = [{"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(s))} for s in (1, 2, 3)]
    ta = merge("task_arithmetic", states, base=base, scaling=1 / 3)
    assert torch.allclose(ta["w"], merge("average", states)["w"], atol=1e-6)


def test_non_float_tensors_taken_from_first_model():
    merged = merge("average", _states([1.0, 3.0]))
    assert merged["n"].dtype == torch.int64 and merged["n"].item() == 7


def test_dtype_preserved():
    states = [{"w": torch.ones(3, dtype=torch.float16) * v} for v in (1, 2)]
    assert merge("average", states)["w"].dtype == torch.float16


def test_task_arithmetic_needs_base():
    with pytest.raises(MergeflowError, match="needs the base model"):
        merge("task_arithmetic", _states([1.0, 2.0]))


def test_unknown_method_and_bad_option_are_clear():
    with pytest.raises(MergeflowError, match="unknown merge method 'nope'"):
        merge("nope", _states([1.0]))
    with pytest.raises(ConfigError, match="task_arithmetic.bogus"):
        merge("task_arithmetic", _states([1.0]), base=_states([0.0])[0], bogus=1)


def test_mismatched_architectures_are_refused():
    states = [{"w": torch.ones(2, 3)}, {"w": torch.ones(3, 2)}]
    with pytest.raises(MergeflowError, match="architectures differ"):
        merge("average", states)
    with pytest.raises(MergeflowError, match="different tensors"):
        merge("average", [{"w": torch.ones(2)}, {"v": torch.ones(2)}])


def test_registering_a_new_method_is_one_function():
    @merge_method("test_max")
    def test_max(tensors, *, base, weights, options):
        """Elementwise maximum."""
        return torch.stack(tensors).amax(dim=0)

    try:
        assert merge("test_max", _states([1.0, 5.0, 2.0]))["w"].max().item() == 5.0
        assert METHODS["test_max"].summary == "Elementwise maximum."
        with pytest.raises(ValueError, match="registered twice"):
            merge_method("test_max")(test_max)
    finally:
        del REGISTRY["test_max"]
