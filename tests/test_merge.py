"""Merge methods checked against closed forms, and the registry's contract."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from mergeflow.errors import ConfigError, MergeflowError
from mergeflow.merge import METHODS, merge, merge_method, run_merge
from mergeflow.schema.merge import DECLARED, TiesOptions


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
    with pytest.raises(MergeflowError, match="merge method 'nope' is unknown"):
        merge("nope", _states([1.0]))
    with pytest.raises(ConfigError, match="task_arithmetic.bogus"):
        merge("task_arithmetic", _states([1.0]), base=_states([0.0])[0], bogus=1)


def test_mismatched_architectures_are_refused():
    states = [{"w": torch.ones(2, 3)}, {"w": torch.ones(3, 2)}]
    with pytest.raises(MergeflowError, match="architectures differ"):
        merge("average", states)
    with pytest.raises(MergeflowError, match="different tensors"):
        merge("average", [{"w": torch.ones(2)}, {"v": torch.ones(2)}])


def elementwise_max(x, options):
    """Elementwise maximum."""
    return torch.stack(x.tensors).amax(dim=0)


def test_registering_a_new_method_is_one_function():
    merge_method("test_max")(elementwise_max)  # as ``@merge_method("test_max")`` would, on a notebook's function
    try:
        assert merge("test_max", _states([1.0, 5.0, 2.0]))["w"].max().item() == 5.0
        assert METHODS["test_max"].implementation == f"{__name__}:elementwise_max"
        assert DECLARED["test_max"].needs == frozenset()  # declared by its registration
        with pytest.raises(ValueError, match="registered twice"):
            merge_method("test_max")(elementwise_max)
    finally:
        del DECLARED["test_max"]
    with pytest.raises(ValueError, match="top level of a module"):

        @merge_method("local_max")
        def local_max(x, options):
            return x.tensors[0]


def test_options_are_a_validated_model_or_keywords():
    base, states = _states([1.0])[0], _states([2.0, 4.0])
    model = DECLARED["task_arithmetic"].parse({"scaling": 0.5})
    assert torch.equal(
        merge("task_arithmetic", states, base=base, options=model)["w"],
        merge("task_arithmetic", states, base=base, scaling=0.5)["w"],
    )
    with pytest.raises(MergeflowError, match="not both"):
        merge("task_arithmetic", states, base=base, options=model, scaling=0.5)


def test_every_builtin_method_is_declared_torch_free_and_its_module_imported_only_when_run():
    # In a fresh process: the declarations import no torch, the package no method's module, a merge only its own.
    code = (
        "import sys; from mergeflow.schema import merge; assert 'torch' not in sys.modules; "
        "import mergeflow.merge, torch; assert mergeflow.merge.METHODS is merge.DECLARED; "
        "loaded = lambda: {m for m in sys.modules if m.startswith('mergeflow.merge.')}; "
        "assert 'mergeflow.merge.della' not in loaded(), loaded(); "
        "mergeflow.merge.merge('average', [{'w': torch.ones(2)}]); "
        "assert loaded() == {'mergeflow.merge.engine', 'mergeflow.merge.sums', 'mergeflow.merge.average'}, loaded()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    for name, method in DECLARED.items():
        assert callable(method.load()) and (method.masks is None or callable(method.load(method.masks))), name
    assert DECLARED["ties"].Options is TiesOptions and DECLARED["ties"].needs == {"base"}
    assert DECLARED["exact"].uses == {"fishers", "factors", "base"}
    assert DECLARED["ties"].modules == ("mergeflow.merge.ties",)
    # a tensor that no Fisher covers is averaged
    assert DECLARED["fisher"].modules == ("mergeflow.merge.fisher", "mergeflow.merge.average")
    with pytest.raises(ValueError, match="'ties' is registered twice"):
        merge_method("ties", needs={"sizes"})(elementwise_max)


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
    weighted = merge("fisher", states, fishers=fishers, by_size=False, coefficients=[1, 3])
    assert torch.allclose(weighted["w"], torch.tensor([(1 * 1 * 1 + 3 * 3 * 3) / 10, (1 * 3 * 2 + 3 * 1 * 6) / 6]))
    with pytest.raises(MergeflowError, match="needs fishers"):
        merge("fisher", states)


def test_fisher_merge_normalizes_by_each_clients_norm_over_all_tensors():
    states = [
        {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([10.0])},
        {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor([20.0])},
    ]
    fishers = [
        {"w": torch.tensor([1.0, 3.0]), "b": torch.tensor([2.0])},
        {"w": torch.tensor([6.0, 2.0]), "b": torch.tensor([9.0])},
    ]
    norms = [14**0.5, 11.0]  # √(1 + 9 + 4), √(36 + 4 + 81): one norm per client, not per tensor
    merged = merge("fisher", states, fishers=fishers, by_size=False, normalize=True)
    for key in ("w", "b"):
        precision = [f[key] / n for f, n in zip(fishers, norms, strict=True)]
        expected = sum(p * s[key] for p, s in zip(precision, states, strict=True)) / sum(precision)
        torch.testing.assert_close(merged[key], expected)
    assert not torch.allclose(merged["w"], merge("fisher", states, fishers=fishers, by_size=False)["w"])


def _linear_gaussian(overlap=0.0):
    """Client posteriors of one linear-Gaussian model (prior precision 2), and the pooled posterior."""
    from mergeflow.reproductions.linear_gaussian import linear_gaussian_problem

    p = linear_gaussian_problem(n=90, dim=4, noise_std=0.3, prior_precision=2.0, overlap=overlap, correlation=1.0)
    assert p.fisher_error < 1e-12  # F = ΦᵀΦ/(nσ²) in closed form
    return p.states, p.fishers, p.factors, p.sizes, p.pooled_mean


@pytest.mark.parametrize("overlap", [0.0, 0.4])
def test_exact_merge_recovers_the_full_data_posterior_mean(overlap):
    states, fishers, factors, sizes, full = _linear_gaussian(overlap)
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
    result = run_merge("exact", states, weights=sizes, fishers=fishers, prior_precision=0.0)
    diagonal = merge("fisher", states, weights=sizes, fishers=fishers, floor=0.0)
    for key in result.state:
        torch.testing.assert_close(result.state[key], diagonal[key], rtol=1e-10, atol=1e-12)
    assert result.summary["cg_iterations"] == 1  # without factors the preconditioner inverts the diagonal system


def test_exact_merge_keeps_the_base_where_no_client_has_data_and_pools_the_prior_from_it():
    # Coordinate 0: data in every client; coordinate 1: no Fisher anywhere (a weight no client's data touched).
    base = {"w": torch.tensor([0.0, 2.0], dtype=torch.float64)}
    states = [
        {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)},
        {"w": torch.tensor([3.0, 2.0], dtype=torch.float64)},
    ]
    fishers = [{"w": torch.tensor([1.0, 0.0], dtype=torch.float64)}] * 2
    delta = 0.5
    with_base = run_merge("exact", states, base=base, fishers=fishers, by_size=False, prior_precision=delta).state["w"]
    zero = run_merge("exact", states, fishers=fishers, by_size=False, prior_precision=delta).state["w"]
    # The product of N(θ_k, (F_k + δ)⁻¹) over the prior N(θ₀, δ⁻¹) counted once, coordinate by coordinate:
    # (Σ(F_k + δ)θ_k − δθ₀) / (ΣF_k + δ).
    assert float(with_base[0]) == pytest.approx((1.5 * 1 + 1.5 * 3 - 0.5 * 0) / 2.5)
    assert float(with_base[1]) == pytest.approx(2.0)  # the base weight, not 2 × 2.0
    assert float(zero[1]) == pytest.approx(4.0)  # a zero-mean prior: the sum of the clients' weights
    with pytest.raises(MergeflowError, match="prior_mean 'base' needs the base model"):
        run_merge("exact", states, fishers=fishers, prior_precision=delta, prior_mean="base", by_size=False)


@pytest.mark.parametrize("preconditioner", ["jacobi", "woodbury"])
def test_exact_merge_is_the_same_without_the_preconditioner(preconditioner):
    states, fishers, factors, sizes, full = _linear_gaussian()
    inputs = {"weights": sizes, "fishers": fishers, "factors": factors, "prior_precision": 2.0}
    plain = run_merge("exact", states, preconditioner="none", **inputs)
    preconditioned = run_merge("exact", states, preconditioner=preconditioner, **inputs)
    for key in plain.state:
        torch.testing.assert_close(plain.state[key], preconditioned.state[key], rtol=1e-9, atol=1e-12)


def test_jacobi_preconditioner_divides_by_the_diagonal_of_the_whole_precision():
    from mergeflow.merge.engine import model_inputs
    from mergeflow.merge.exact import _preconditioner
    from mergeflow.merge.precision import client_precisions

    states, fishers, factors, sizes, _ = _linear_gaussian()
    clients = client_precisions(model_inputs(states, weights=sizes, fishers=fishers, factors=factors), by_size=True)
    delta, dim = 2.0, len(clients[0].theta)
    dense = sum(torch.stack([c.matvec(e) for e in torch.eye(dim, dtype=torch.float64)]) for c in clients)
    r = torch.arange(1.0, dim + 1, dtype=torch.float64)
    torch.testing.assert_close(_preconditioner("jacobi", clients, delta)(r), r / (torch.diagonal(dense) + delta))


def test_woodbury_preconditioner_solves_an_ill_conditioned_low_rank_system_in_few_iterations():
    generator = torch.Generator().manual_seed(0)
    dim, rows = 400, 30
    # half the coordinates have no Fisher at all: only the tiny prior precision holds them
    fishers, factors, states = [], [], []
    for _ in range(3):
        u = torch.randn(rows, dim, generator=generator, dtype=torch.float64) * 3
        u[:, dim // 2 :] = 0
        factors.append(u / rows**0.5)
        fishers.append({"w": (factors[-1] ** 2).sum(0) + 1e-3})
        states.append({"w": torch.randn(dim, generator=generator, dtype=torch.float64)})
    inputs = {"weights": [50, 60, 70], "fishers": fishers, "factors": factors, "prior_precision": 1e-6}
    woodbury = run_merge("exact", states, **inputs)
    jacobi = run_merge("exact", states, preconditioner="jacobi", max_iterations=50, **inputs)
    assert woodbury.summary["cg_relative_residual"] < 1e-10
    assert woodbury.summary["cg_iterations"] <= 2  # the float64 Woodbury inverse is exact up to rounding
    assert jacobi.summary["cg_relative_residual"] > 1e3 * woodbury.summary["cg_relative_residual"]


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


def _flat(state):
    return np.concatenate([state["1.weight"].numpy().ravel(), state["1.bias"].numpy()])


@pytest.mark.parametrize("base_shift", [None, 3.0])
def test_ssf_with_the_full_mask_converges_to_the_exact_merge(base_shift):
    states, fishers, factors, sizes, _ = _linear_gaussian()
    inputs = {"weights": sizes, "fishers": fishers, "factors": factors, "prior_precision": 2.0}
    if base_shift is not None:  # the prior centred at a base model, not at zero
        without = _flat(merge("exact", states, **inputs))
        inputs["base"] = {k: v + base_shift for k, v in states[0].items()}
        assert np.linalg.norm(_flat(merge("exact", states, **inputs)) - without) > 1e-2 * np.linalg.norm(without)
    exact = _flat(merge("exact", states, **inputs))
    result = run_merge(
        "ssf",
        states,
        **inputs,
        mask_rate=1.0,
        window=None,
        steps=800,
        masks_per_step=1,
        optimizer="adam",
        lr=0.05,
        start="random",
    )
    assert np.linalg.norm(_flat(result.state) - exact) / np.linalg.norm(exact) < 1e-4
    assert result.curves["ssf_loss"][-1] < result.curves["ssf_loss"][0]


def test_ssf_windows_keep_the_exact_merge_only_when_precisions_are_diagonal():
    # A mask looks at a window of 2 of the 5 coordinates and conditions on nothing outside it. With
    # diagonal precisions the coordinates are independent, so the full mask's fixed point is still
    # the exact merge; with factors coupling them, a window's marginal is not the conditional.
    states, fishers, factors, sizes, _ = _linear_gaussian()
    ssf = {"mask_rate": 1.0, "window": 2, "steps": 800, "masks_per_step": 1, "optimizer": "adam", "lr": 0.05}
    diagonal = {"weights": sizes, "fishers": fishers, "prior_precision": 2.0}
    gaps = {}
    for name, inputs in (("diagonal", diagonal), ("coupled", {**diagonal, "factors": factors})):
        exact = _flat(merge("exact", states, **inputs))
        windowed = _flat(run_merge("ssf", states, **inputs, **ssf, start="random").state)
        gaps[name] = np.linalg.norm(windowed - exact) / np.linalg.norm(exact)
    assert gaps["diagonal"] < 1e-8 and gaps["coupled"] > 1e-3, gaps


def test_ssf_with_random_masks_approaches_the_exact_merge():
    states, fishers, factors, sizes, _ = _linear_gaussian()
    inputs = {"weights": sizes, "fishers": fishers, "factors": factors, "prior_precision": 2.0}
    exact = _flat(merge("exact", states, **inputs))
    average = _flat(merge("average", states))
    result = run_merge(
        "ssf",
        states,
        **inputs,
        mask_rate=0.4,
        window=None,
        steps=600,
        masks_per_step=20,
        optimizer="adam",
        lr=0.02,
        seed=3,
    )
    # Partial masks make Eq. 7 a pseudo-likelihood: it lands near, not on, the exact merge
    # (the paper's Fig. 1 reports the same small bias), but clearly closer than averaging.
    error = np.linalg.norm(_flat(result.state) - exact)
    assert error < 0.6 * np.linalg.norm(average - exact)
    again = run_merge(
        "ssf",
        states,
        **inputs,
        mask_rate=0.4,
        window=None,
        steps=600,
        masks_per_step=20,
        optimizer="adam",
        lr=0.02,
        seed=3,
    )
    assert all(torch.equal(result.state[k], again.state[k]) for k in result.state)  # deterministic


def test_ssf_loss_stays_bounded_with_partial_masks_where_eq7_as_printed_runs_away():
    # Five clients whose precisions couple 16 coordinates through 2 factor rows each (10 < 16), a strong
    # prior and 2 masked coordinates a mask: subtracting the prior after conditioning (Eq. 7 as printed)
    # is unbounded below here; taking it out of each client's Gaussian first is a sum of proper conditionals.
    from mergeflow.merge.engine import model_inputs
    from mergeflow.merge.ssf import ssf_iterates
    from mergeflow.schema.merge import SSFOptions

    g = torch.Generator().manual_seed(0)
    count, dim = 5, 16
    states = [{"w": torch.randn(dim, generator=g, dtype=torch.float64)} for _ in range(count)]
    factors = [torch.randn(2, dim, generator=g, dtype=torch.float64) for _ in range(count)]
    fishers = [{"w": (f**2).sum(0)} for f in factors]
    inputs = {"weights": [100.0] * count, "fishers": fishers, "factors": factors}
    exact = merge("exact", states, **inputs, prior_precision=10.0)["w"].norm()
    options = {"mask_rate": 0.125, "masks_per_step": 8, "steps": 1000, "window": None, "lr": 0.05}
    options |= {"optimizer": "adam", "schedule": "constant", "start": "average", "prior_precision": 10.0}
    x = model_inputs(states, **inputs)
    bounded = list(ssf_iterates(x, SSFOptions(**options)))
    printed = list(ssf_iterates(x, SSFOptions(**options, prior_correction="as_printed")))
    assert min(loss for _, loss in bounded) >= 0 and bounded[-1][0].norm() < 1.5 * exact
    assert printed[-1][1] < -1000 and printed[-1][0].norm() > 4 * exact


def test_ssf_iterates_are_the_same_with_a_formed_precision_and_with_factors(monkeypatch):
    import mergeflow.merge.ssf as ssf_module

    states, fishers, factors, sizes, _ = _linear_gaussian()
    inputs = {"weights": sizes, "fishers": fishers, "factors": factors, "prior_precision": 2.0}
    options = {"mask_rate": 0.4, "window": None, "steps": 30, "masks_per_step": 5, "seed": 1}
    calls = []
    form = ssf_module._dense_precision
    monkeypatch.setattr(ssf_module, "_dense_precision", lambda *args: calls.append(1) or form(*args))
    formed = run_merge("ssf", states, **inputs, **options)
    assert len(calls) == len(states)
    monkeypatch.setattr(ssf_module, "_DENSE_MAX_BYTES", 0)
    factored = run_merge("ssf", states, **inputs, **options)
    assert len(calls) == len(states)
    for key in formed.state:
        torch.testing.assert_close(formed.state[key], factored.state[key], rtol=1e-10, atol=1e-12)


def test_ssf_without_factors_optimises_the_diagonal_objective():
    states, fishers, _, sizes, _ = _linear_gaussian()
    exact_diagonal = _flat(merge("exact", states, weights=sizes, fishers=fishers, prior_precision=2.0))
    result = merge(
        "ssf",
        states,
        weights=sizes,
        fishers=fishers,
        prior_precision=2.0,
        mask_rate=0.5,
        window=None,
        steps=800,
        masks_per_step=10,
        optimizer="adam",
        lr=0.05,
    )
    np.testing.assert_allclose(_flat(result), exact_diagonal, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(
    ("rows", "formed"),
    [(3, False), (12, False), (12, True)],  # Woodbury, direct from factors, gathered from a formed Λ
)
def test_ssf_conditional_matches_the_dense_gaussian_conditional(rows, formed):
    from mergeflow.merge.precision import ClientPrecision
    from mergeflow.merge.ssf import _conditional_quadratic, _dense_precision, _masked_system

    g = torch.Generator().manual_seed(rows)
    dim, delta = 10, 0.5
    client = ClientPrecision(
        torch.randn(dim, generator=g, dtype=torch.float64),
        torch.randn(rows, dim, generator=g, dtype=torch.float64),
        torch.rand(dim, generator=g, dtype=torch.float64),
    )
    theta = torch.randn(dim, generator=g, dtype=torch.float64)
    masked, rest = torch.tensor([[1, 4, 7, 2, 9, 0]]), torch.tensor([[3, 5, 6, 8]])
    precision = client.factors.T @ client.factors + torch.diag(client.diagonal + delta)
    m, r = masked[0], rest[0]
    lam_mm, lam_mr = precision[m][:, m], precision[m][:, r]
    mean = client.theta[m] - torch.linalg.solve(lam_mm, lam_mr @ (theta[r] - client.theta[r]))
    dense = (theta[m] - mean) @ lam_mm @ (theta[m] - mean)
    system = _masked_system(client, delta, masked, rest, _dense_precision(client, delta) if formed else None)
    assert formed or system.direct == (rows >= 6)
    torch.testing.assert_close(_conditional_quadratic(theta - client.theta, system, masked, rest), dense)


def test_merge_step_orders_factor_columns_like_the_model_not_like_the_file(tmp_path):
    """With five hidden layers, "11.weight" sorts before "3.weight" in a safetensors file."""
    from safetensors.torch import save_file

    from mergeflow.checkpoints import load_checkpoint, save_checkpoint
    from mergeflow.fisher import diagonal_fisher, fisher_factors
    from mergeflow.models import build_from_spec, parameter_names
    from mergeflow.models.sequential import model_spec
    from tasks.layout import BASE, aligned_checkpoint, aligned_factors, aligned_fisher, merged_checkpoint
    from tasks.merging import merge_clients

    spec = model_spec("mlp", [4], 3, widths=[3] * 5)
    names = parameter_names(spec)
    assert names != sorted(names)
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(40, 4, generator=generator)
    y = torch.randint(0, 3, (40,), generator=generator)
    states, fishers, factors = [], [], []
    base = build_from_spec(spec).state_dict()
    save_checkpoint(tmp_path / BASE, base, {"spec": spec})
    for client in range(2):
        model = build_from_spec({**spec, "seed": client + 1})
        states.append(model.state_dict())
        fishers.append(diagonal_fisher(model, X, y, kind="empirical"))
        factors.append(fisher_factors(model, X[:8], y[:8], kind="empirical"))
        save_checkpoint(tmp_path / aligned_checkpoint(client), states[-1], {"spec": spec, "num_examples": 40})
        save_file(fishers[-1], str(tmp_path / aligned_fisher(client)))
        save_file({"U": factors[-1]}, str(tmp_path / aligned_factors(client)))
    options = {"prior_precision": 0.01}
    step = {"name": "exact", "method": "exact", "options": options, "num_clients": 2, "factors": True}
    merge_clients(step, tmp_path, tmp_path / "out", {})
    merged, _ = load_checkpoint(tmp_path / "out" / merged_checkpoint("exact"))
    expected = merge("exact", states, base=base, weights=[40, 40], fishers=fishers, factors=factors, **options)
    for key in names:
        torch.testing.assert_close(merged[key], expected[key])


def test_linear_gaussian_reproduction_exact_merge_is_the_pooled_posterior_and_ssf_curves_are_logged():
    from mergeflow.reproductions.linear_gaussian import (
        LinearGaussianSettings,
        linear_gaussian_problem,
        run_linear_gaussian,
    )

    settings = LinearGaussianSettings(
        n=120, n_test=50, dim=4, correlation=1.0, mask_rates=[0.5, 1.0], ssf={"steps": 40, "masks_per_step": 5}
    )
    table, curves = run_linear_gaussian(settings)
    assert table["exact"]["relative_error_to_pooled_posterior"] < 1e-8  # the prior counted once
    pooled = table["pooled posterior (closed form)"]
    assert pooled["relative_error_to_pooled_posterior"] == 0
    problem = linear_gaussian_problem(**settings.model_dump(exclude={"ssf", "mask_rates"}))
    X_test, t_test = problem.test
    design = np.hstack([X_test, np.ones((len(X_test), 1))])  # weights, then the bias
    assert pooled["parameter_mse_to_truth"] == pytest.approx(np.mean((problem.pooled_mean - problem.true_weights) ** 2))
    assert pooled["test_mse"] == pytest.approx(np.mean((design @ problem.pooled_mean - t_test) ** 2))
    assert pooled["test_mse"] < table["average"]["test_mse"]  # the pooled posterior predicts better than the mean
    for metric in ("relative_error_to_pooled_posterior", "parameter_mse_to_truth"):
        assert table["ssf 50%"][metric] == curves[f"ssf 50%/{metric}"][-1]  # the table is SSF's last step
    for metric in ("relative_error_to_pooled_posterior", "parameter_mse_to_truth", "ssf_loss"):
        assert len(curves[f"ssf 50%/{metric}"]) == 40
    full = curves["ssf 100%/relative_error_to_pooled_posterior"]
    assert full[-1] < full[0]  # the full mask's objective is the exact merge's: SSF moves towards it


def test_woodbury_inverse_in_strips_and_column_blocks_equals_a_dense_solve():
    from mergeflow.merge.exact import woodbury_inverse
    from mergeflow.merge.precision import ClientPrecision

    generator = torch.Generator().manual_seed(1)
    dim = 300
    diagonal = torch.rand(dim, generator=generator, dtype=torch.float64) + 0.1
    factors = [
        torch.randn(7, dim, generator=generator),  # float32, widened block by block
        torch.randn(5, dim, generator=generator, dtype=torch.float64),
        torch.zeros(0, dim, dtype=torch.float64),  # a client without factors
    ]
    scales = [2.0, 0.5, 3.0]
    clients = [ClientPrecision(torch.zeros(dim), u, torch.zeros(dim), s) for u, s in zip(factors, scales, strict=True)]
    dense = torch.diag(diagonal) + sum(s * u.double().T @ u.double() for u, s in zip(factors, scales, strict=True))
    v = torch.randn(dim, generator=generator, dtype=torch.float64)
    expected = torch.linalg.solve(dense, v)
    for columns, strip in ((1 << 15, 128), (64, 5)):  # one block and strip, or a partial last block and strip
        solved = woodbury_inverse(diagonal, clients, columns=columns, strip=strip)(v)
        torch.testing.assert_close(solved, expected, rtol=1e-10, atol=1e-12)
        # float32 products: a preconditioner within float32's rounding of the exact inverse
        approximate = woodbury_inverse(diagonal, clients, columns=columns, strip=strip, build_dtype=torch.float32)(v)
        assert 0 < float((approximate - expected).norm() / expected.norm()) < 1e-5


def test_the_exact_inverse_of_more_factor_rows_than_parameters_is_the_dense_matrix_s(monkeypatch):
    """Many clients of a small model: the R x R Woodbury capacitance would grow with the square of the clients
    (51 GB for 1,000 clients of 80 rows), so the D x D matrix is inverted instead, to the same result."""
    from mergeflow.merge import exact
    from mergeflow.merge.precision import ClientPrecision

    generator = torch.Generator().manual_seed(2)
    dim, delta = 20, 0.1
    factors = [torch.randn(8, dim, generator=generator) for _ in range(5)]  # 40 rows > 20 parameters
    clients = [ClientPrecision(torch.zeros(dim), u, torch.rand(dim, dtype=torch.float64), 0.5) for u in factors]
    dense = torch.diag(sum(c.diagonal for c in clients) + delta) + sum(0.5 * u.double().T @ u.double() for u in factors)
    v = torch.randn(dim, generator=generator, dtype=torch.float64)
    monkeypatch.setattr(exact, "woodbury_inverse", None)  # the R x R path is not taken
    solved = exact.woodbury_preconditioner(clients, delta)(v)
    torch.testing.assert_close(solved, torch.linalg.solve(dense, v), rtol=1e-10, atol=1e-12)
