"""Merge methods checked against closed forms, and the registry's contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergeflow.errors import ConfigError, MergeflowError
from mergeflow.merge import METHODS, merge, merge_method, run_merge
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


def test_weighted_without_weights_is_refused():
    with pytest.raises(MergeflowError, match="needs sizes"):
        merge("weighted", _states([1.0, 4.0]))


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
    with pytest.raises(MergeflowError, match="needs base"):
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
    def test_max(x, options):
        """Elementwise maximum."""
        return torch.stack(x.tensors).amax(dim=0)

    try:
        assert merge("test_max", _states([1.0, 5.0, 2.0]))["w"].max().item() == 5.0
        assert METHODS["test_max"].summary == "Elementwise maximum."
        with pytest.raises(ValueError, match="registered twice"):
            merge_method("test_max")(test_max)
    finally:
        del REGISTRY["test_max"]


def test_fisher_merge_closed_form():
    states = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}]
    fishers = [{"w": torch.tensor([1.0, 3.0])}, {"w": torch.tensor([3.0, 1.0])}]
    merged = merge("fisher", states, fishers=fishers, by_size=False)
    expected = torch.tensor([(1 * 1 + 3 * 3) / 4, (3 * 2 + 1 * 6) / 4])
    assert torch.allclose(merged["w"], expected)
    by_size = merge("fisher", states, fishers=fishers, weights=[3, 1])
    assert torch.allclose(by_size["w"][0], torch.tensor((3 * 1 * 1 + 1 * 3 * 3) / (3 * 1 + 1 * 3.0)))
    normalized = merge("fisher", states, fishers=fishers, by_size=False, normalize=True)
    assert torch.allclose(normalized["w"], expected)  # equal norms: unchanged
    with pytest.raises(MergeflowError, match="needs fishers"):
        merge("fisher", states)


def _linear_gaussian(clients=3, n=90, d=4, sigma=0.3, delta=2.0, seed=0):
    """Disjoint client data of one linear-Gaussian model, the client posteriors, and the full posterior."""
    from mergeflow.fisher import diagonal_fisher, fisher_factors
    from mergeflow.models import build_model

    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = X @ rng.normal(size=d) + 0.5 + sigma * rng.normal(size=n)
    A = np.concatenate([X, np.ones((n, 1))], axis=1)

    def posterior(rows):
        precision = A[rows].T @ A[rows] / sigma**2 + delta * np.eye(d + 1)
        return np.linalg.solve(precision, A[rows].T @ y[rows] / sigma**2)

    parts = np.array_split(np.arange(n), clients)
    states, fishers, factors = [], [], []
    for rows in parts:
        mean = posterior(rows)
        model = build_model("linear", [d], 1).double()
        with torch.no_grad():
            model[1].weight.copy_(torch.from_numpy(mean[:d])[None])
            model[1].bias.copy_(torch.tensor([mean[d]]))
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        kwargs = {"kind": "exact", "task": "regression", "noise_std": sigma}
        fishers.append(diagonal_fisher(model, X[rows], y[rows], **kwargs))
        factors.append(fisher_factors(model, X[rows], y[rows], **kwargs))
    sizes = [len(rows) for rows in parts]
    return states, fishers, factors, sizes, posterior(np.arange(n))


def test_exact_merge_recovers_the_full_data_posterior_mean():
    states, fishers, factors, sizes, full = _linear_gaussian()
    result = run_merge("exact", states, weights=sizes, fishers=fishers, factors=factors, prior_precision=2.0)
    merged = np.concatenate([result.state["1.weight"].numpy().ravel(), result.state["1.bias"].numpy()])
    assert np.linalg.norm(merged - full) / np.linalg.norm(full) < 1e-8
    assert result.summary["cg_relative_residual"] < 1e-10
    assert 1 <= result.summary["cg_iterations"] <= 5 * 3  # at most D steps in exact arithmetic, D = 5
    assert result.curves["cg_relative_residual"][-1] < 1e-10
    average = merge("average", states)
    averaged = np.concatenate([average["1.weight"].numpy().ravel(), average["1.bias"].numpy()])
    assert np.linalg.norm(averaged - full) > 1e3 * np.linalg.norm(merged - full)


def test_exact_without_factors_and_prior_is_the_diagonal_fisher_merge():
    states, fishers, _, sizes, _ = _linear_gaussian()
    exact = merge("exact", states, weights=sizes, fishers=fishers, prior_precision=0.0)
    diagonal = merge("fisher", states, weights=sizes, fishers=fishers, floor=0.0)
    for key in exact:
        torch.testing.assert_close(exact[key], diagonal[key], rtol=1e-10, atol=1e-12)


def test_exact_refuses_factors_of_the_wrong_width():
    states, fishers, factors, sizes, _ = _linear_gaussian()
    with pytest.raises(MergeflowError, match="columns"):
        merge("exact", states, weights=sizes, fishers=fishers, factors=[f[:, :3] for f in factors])


def test_checkpoints_refuse_pickles_and_detect_truncation(tmp_path):
    from mergeflow.checkpoints import load_checkpoint, save_checkpoint

    state = {"w": torch.arange(40, dtype=torch.float32)}
    save_checkpoint(tmp_path / "ok.safetensors", state, {"role": "test"})
    loaded, meta = load_checkpoint(tmp_path / "ok.safetensors")
    assert torch.equal(loaded["w"], state["w"]) and meta == {"role": "test"}
    torch.save(state, tmp_path / "model.pt")
    with pytest.raises(MergeflowError, match="never unpickles"):
        load_checkpoint(tmp_path / "model.pt")
    data = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(MergeflowError, match="corrupt or truncated"):
        load_checkpoint(tmp_path / "cut.safetensors")
    assert not list(tmp_path.glob("*.tmp"))
