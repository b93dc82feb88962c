"""Alignment: derived permutation specs, weight/activation matching, permuting Fishers and factors, loss barriers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits
from torch import nn

from mergeflow.align import (
    PermutationSpec,
    activation_matching,
    align_models,
    apply_permutation,
    compose_permutations,
    goal_statistics,
    interpolate,
    invert_permutation,
    loss_barrier,
    make_loss_fn,
    make_metric_fn,
    permutation_spec,
    permute_flat_columns,
    random_permutation,
    repair,
    repair_points,
    unit_statistics,
    weight_matching,
)
from mergeflow.align.matching import _record
from mergeflow.fisher import diagonal_fisher, fisher_factors
from mergeflow.models.sequential import build_model
from mergeflow.training import train

CNN = {"arch": "cnn", "input_shape": [1, 8, 8], "output_dim": 10, "channels": [4, 8], "cnn_hidden": 16}
MLP = {"arch": "mlp", "input_shape": [16], "output_dim": 5, "widths": [24, 12]}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: with 2 threads on a busy 2-core machine OpenMP spinning makes a
    training step ~100x slower, so run single-threaded and restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _random_data(shape, n: int = 256, classes: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, *shape), generator=gen), torch.randint(0, classes, (n,), generator=gen)


def _trained(kind: dict, seed: int = 0) -> nn.Sequential:
    """A model after a few SGD steps on random data, so its weights are not just the init."""
    model = build_model(**kind, seed=seed)
    X, y = _random_data(kind["input_shape"], classes=kind["output_dim"], seed=seed)
    train(model, X, y, task="classification", epochs=2, lr=0.05, batch_size=64, seed=seed)
    return model


def _outputs(model: nn.Module, state: dict, x: torch.Tensor) -> torch.Tensor:
    was = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        out = model(x)
    model.load_state_dict(was)
    return out


def _is_identity(perms: dict) -> bool:
    return all(torch.equal(p, torch.arange(len(p))) for p in perms.values())


# --- the derived spec --------------------------------------------------------------------------


def test_cnn_spec_follows_flatten_blocks_and_leaves_input_and_output_alone():
    model = build_model(**CNN)
    spec = permutation_spec(model, CNN["input_shape"])
    assert [g.size for g in spec.groups.values()] == [4, 8, 16]
    by_key = spec.by_key()
    # conv 2 (8 channels) feeds the Linear through MaxPool(2) + Flatten: blocks of 4 * 4 columns.
    assert ("P_1", 1, 16, 1) in by_key["6.weight"]
    assert all(axis == 0 for _, axis, _, _ in by_key["0.weight"])  # the input channels stay put
    assert "8.bias" not in by_key and all(axis == 1 for _, axis, _, _ in by_key["8.weight"])  # so do the outputs
    assert PermutationSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_spec_rejects_residual_connections_and_drops_mixing_group_norms():
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.c(h + self.b(h))

    with pytest.raises(ValueError, match="not a plain chain"):
        permutation_spec(Residual(), [4])
    model = nn.Sequential(nn.Conv2d(2, 8, 3), nn.GroupNorm(2, 8), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3))
    with pytest.warns(UserWarning, match="left unpermuted"):
        assert permutation_spec(model, [2, 4, 4]).groups == {}


# --- permutations preserve the function (property) ---------------------------------------------


def _normed_mlp(widths: list[int], seed: int) -> nn.Sequential:
    """Linear, BatchNorm1d, ReLU, Linear, LayerNorm, Tanh, Dropout, ..., Linear with random norm statistics."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Flatten()]
    n_in = 6
    for i, width in enumerate(widths):
        norm = nn.BatchNorm1d(width) if i % 2 == 0 else nn.LayerNorm(width)
        layers += [nn.Linear(n_in, width), norm, nn.ReLU() if i % 2 == 0 else nn.Tanh(), nn.Dropout(0.3)]
        n_in = width
    layers.append(nn.Linear(n_in, 3))
    model = nn.Sequential(*layers)
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in model.state_dict().items():
        if name.endswith("running_var"):
            tensor.uniform_(0.5, 2.0, generator=gen)
        elif tensor.is_floating_point():
            tensor.normal_(generator=gen)
    return model.eval()


@settings(max_examples=25, deadline=None)
@given(
    widths=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    activation=st.sampled_from(["relu", "tanh"]),
    channels=st.lists(st.integers(1, 6), min_size=1, max_size=2),
    hidden=st.integers(1, 10),
    normed=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_any_permutation_from_the_spec_keeps_outputs(widths, activation, channels, hidden, normed, seed):
    models = [
        (build_model("mlp", [6], 4, widths=widths, activation=activation, seed=seed % 1000), [6]),
        (build_model("cnn", [2, 6, 6], 3, channels=channels, cnn_hidden=hidden, seed=seed % 1000), [2, 6, 6]),
    ]
    if normed:
        models.append((_normed_mlp(widths, seed % 1000), [6]))
    for model, shape in models:
        spec = permutation_spec(model, shape, check=False)
        assert [g.size for g in spec.groups.values()] == (channels + [hidden] if len(shape) == 3 else widths)
        perms = random_permutation(spec, seed)
        x = torch.randn((8, *shape), generator=torch.Generator().manual_seed(seed))
        state = model.state_dict()
        permuted = apply_permutation(spec, state, perms)
        torch.testing.assert_close(_outputs(model, permuted, x), _outputs(model, state, x), rtol=1e-5, atol=1e-5)
        back = apply_permutation(spec, permuted, invert_permutation(perms))
        assert all(torch.equal(back[k], state[k]) for k in state)


# --- weight and activation matching ------------------------------------------------------------


@pytest.mark.parametrize("kind", [MLP, CNN], ids=["mlp", "cnn"])
def test_weight_matching_recovers_a_permuted_copy(kind):
    model = _trained(kind)
    spec = permutation_spec(model, kind["input_shape"])
    state = model.state_dict()
    perms = random_permutation(spec, 7)
    assert not _is_identity(perms)
    permuted = apply_permutation(spec, state, perms)
    result = weight_matching(spec, state, permuted, seed=3)
    aligned = apply_permutation(spec, permuted, result.perms)
    for key in state:
        torch.testing.assert_close(aligned[key], state[key], rtol=0, atol=1e-6)
    assert _is_identity(compose_permutations(perms, result.perms))
    assert result.converged
    assert result.objectives[-1] == pytest.approx(sum(float((state[k].double() ** 2).sum()) for k in spec.keys()))
    x, _ = _random_data(kind["input_shape"], n=32, seed=5)
    torch.testing.assert_close(_outputs(model, aligned, x), _outputs(model, state, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("metric", ["correlation", "l2"])
@pytest.mark.parametrize("kind", [MLP, CNN], ids=["mlp", "cnn"])
def test_activation_matching_recovers_a_permuted_copy(kind, metric):
    model = _trained(kind)
    spec = permutation_spec(model, kind["input_shape"])
    perms = random_permutation(spec, 11)
    other = build_model(**kind)
    other.load_state_dict(apply_permutation(spec, model.state_dict(), perms))
    inputs, _ = _random_data(kind["input_shape"], n=512, seed=1)
    result = activation_matching(spec, model, other, inputs, metric=metric, batch_size=100)
    assert result.objectives[1] >= result.objectives[0]
    aligned = apply_permutation(spec, other.state_dict(), result.perms)
    torch.testing.assert_close(_outputs(model, aligned, inputs), _outputs(model, model.state_dict(), inputs))
    if kind is MLP:
        assert _is_identity(compose_permutations(perms, result.perms))
    else:  # dead ReLU channels (constant activations) are interchangeable; all the others are recovered
        live = {g: a.std(0) > 0 for (g, _), a in _record(model.eval(), spec, inputs).items()}
        composed = compose_permutations(perms, result.perms)
        assert all(torch.equal(composed[g][live[g]], torch.arange(len(live[g]))[live[g]]) for g in live)


def test_weight_matching_objective_never_decreases():
    kind = {**MLP, "widths": [32, 32, 16]}
    a, b = build_model(**kind, seed=0), build_model(**kind, seed=1)
    spec = permutation_spec(a, kind["input_shape"])
    result = weight_matching(spec, a.state_dict(), b.state_dict(), seed=0)
    steps = np.diff(result.objectives)
    assert len(result.objectives) >= 3 and result.converged
    assert np.all(steps >= -1e-9 * abs(result.objectives[0])), result.objectives
    assert result.objectives[-1] > result.objectives[0]


def test_align_models_leaves_the_reference_alone():
    model = _trained(MLP)
    spec = permutation_spec(model, MLP["input_shape"])
    reference = model.state_dict()
    snapshot = {k: v.clone() for k, v in reference.items()}
    perms = random_permutation(spec, 2)
    states = [reference, apply_permutation(spec, reference, perms)]
    inputs, _ = _random_data(MLP["input_shape"], n=256)
    for method in ("weights", "activations"):
        aligned = align_models(spec, reference, states, method=method, inputs=inputs, model=model)
        assert _is_identity(aligned[0][1])
        for state, _ in aligned:
            assert all(torch.allclose(state[k], reference[k], atol=1e-6) for k in reference)
    assert all(torch.equal(reference[k], snapshot[k]) for k in reference)
    with pytest.raises(ValueError, match="needs inputs"):
        align_models(spec, reference, states, method="activations")


# --- Fishers and gradient factors --------------------------------------------------------------


def test_permuted_fisher_and_factor_columns_match_the_permuted_model():
    model = _trained(MLP)
    spec = permutation_spec(model, MLP["input_shape"])
    perms = random_permutation(spec, 4)
    permuted = build_model(**MLP)
    permuted.load_state_dict(apply_permutation(spec, model.state_dict(), perms))
    X, y = _random_data(MLP["input_shape"], n=40, seed=9)
    names = [n for n, _ in model.named_parameters()]
    shapes = [tuple(p.shape) for _, p in model.named_parameters()]

    fisher = diagonal_fisher(model, X, y, kind="empirical")
    expected = diagonal_fisher(permuted, X, y, kind="empirical")
    for key, value in apply_permutation(spec, fisher, perms).items():
        torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-7)
    partial = {k: v for k, v in fisher.items() if not k.endswith("bias")}
    assert set(apply_permutation(spec, partial, perms)) == set(partial)

    factors = fisher_factors(model, X, y, kind="empirical")
    moved = permute_flat_columns(spec, names, shapes, factors, perms)
    torch.testing.assert_close(moved, fisher_factors(permuted, X, y, kind="empirical"), rtol=1e-4, atol=1e-6)
    # Row by row, the column permutation is flatten(apply_permutation(unflatten(row))).
    sizes = [math.prod(s) for s in shapes]
    for row, moved_row in zip(factors[:3], moved[:3], strict=True):
        pieces = dict(zip(names, [p.reshape(s) for p, s in zip(row.split(sizes), shapes, strict=True)], strict=True))
        flat = torch.cat([apply_permutation(spec, pieces, perms)[n].reshape(-1) for n in names])
        assert torch.equal(flat, moved_row)


# --- loss barrier --------------------------------------------------------------------------------


def test_barrier_of_a_model_with_itself_is_zero():
    model = _trained(MLP)
    X, y = _random_data(MLP["input_shape"], n=64, seed=2)
    result = loss_barrier(make_loss_fn(model, X, y), model.state_dict(), model.state_dict(), n_points=5)
    assert abs(result.barrier) < 1e-12
    assert len(set(result.losses)) == 1


def test_barrier_matches_a_hand_computation():
    a, b = {"w": torch.tensor([0.0])}, {"w": torch.tensor([2.0])}

    def loss_fn(state):
        w = float(state["w"][0])
        return 1 - (w - 1) ** 2 + w  # 0, 1.25, 2, 2.25, 2 at w = 0, .5, 1, 1.5, 2

    result = loss_barrier(loss_fn, a, b, n_points=5)
    assert result.ts == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert result.losses == pytest.approx([0.0, 1.25, 2.0, 2.25, 2.0])
    assert result.barrier == pytest.approx(1.0)  # 2 - (0.5 * 0 + 0.5 * 2) at t = 0.5
    assert result.midpoint_loss == pytest.approx(2.0)

    # Regression through make_loss_fn: loss(w) = 0.5 * mean((w x)²) = 1.25 w² for x = (1, 2), y = 0.
    model = nn.Sequential(nn.Linear(1, 1, bias=False))
    fn = make_loss_fn(model, torch.tensor([[1.0], [2.0]]), torch.zeros(2), task="regression")
    line = loss_barrier(fn, {"0.weight": torch.tensor([[-1.0]])}, {"0.weight": torch.tensor([[3.0]])}, n_points=3)
    assert line.losses == pytest.approx([1.25, 1.25, 11.25])
    assert line.barrier == 0.0  # convex: 1.25 - 6.25 < 0 at t = 0.5, so the endpoints' 0 is the max
    torch.testing.assert_close(interpolate(a, b, 0.25)["w"], torch.tensor([0.5]))


def test_weight_matching_lowers_the_barrier_between_independent_mlps():
    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    y = digits.target
    kind = {"arch": "mlp", "input_shape": [64], "output_dim": 10, "widths": [48, 48]}
    models = []
    for seed in (0, 1):
        model = build_model(**kind, seed=seed)
        train(model, X, y, task="classification", epochs=4, lr=0.1, momentum=0.9, batch_size=128, seed=seed)
        models.append(model)
    spec = permutation_spec(models[0], [64])
    ref, other = models[0].state_dict(), models[1].state_dict()
    result = weight_matching(spec, ref, other, seed=0)
    aligned = apply_permutation(spec, other, result.perms)
    loss_fn, acc_fn = make_loss_fn(models[0], X, y), make_metric_fn(models[0], X, y)
    naive = loss_barrier(loss_fn, ref, other, n_points=5, metric_fn=acc_fn)
    rebased = loss_barrier(loss_fn, ref, aligned, n_points=5, metric_fn=acc_fn)
    assert rebased.losses[-1] == pytest.approx(naive.losses[-1], rel=1e-5)  # same function at t = 1
    assert naive.barrier > 0.1
    assert rebased.barrier < 0.5 * naive.barrier
    assert rebased.midpoint_metric > naive.midpoint_metric


# --- REPAIR --------------------------------------------------------------------------------------


def _digits_pair(widths: list[int], epochs: int):
    """Two MLPs trained on digits from different inits, the second weight-matched to the first."""
    digits = load_digits()
    X = torch.as_tensor((digits.data / 16.0).astype(np.float32))
    y = torch.as_tensor(digits.target)
    kind = {"arch": "mlp", "input_shape": [64], "output_dim": 10, "widths": widths}
    models = []
    for seed in (0, 1):
        model = build_model(**kind, seed=seed)
        train(model, X, y, task="classification", epochs=epochs, lr=0.1, momentum=0.9, batch_size=128, seed=seed)
        models.append(model)
    spec = permutation_spec(models[0], [64])
    ref, other = models[0].state_dict(), models[1].state_dict()
    aligned = apply_permutation(spec, other, weight_matching(spec, ref, other, seed=0).perms)
    return models[0], spec, ref, aligned, X, y


def test_repair_gives_every_unit_the_interpolated_mean_and_std():
    model, spec, ref, aligned, X, _ = _digits_pair([24, 16], epochs=1)
    points = repair_points(model, spec)
    assert [p.module for p in points.values()] == ["1", "3"]  # the Linear layers: pre-activations
    ends = [unit_statistics(model, s, points, X) for s in (ref, aligned)]
    t = 0.3
    merged = interpolate(ref, aligned, t)
    before = unit_statistics(model, merged, points, X)
    goals = goal_statistics(ends, [1 - t, t])
    repaired = repair(model, merged, goals, points, X)
    after = unit_statistics(model, repaired, points, X)
    for name, (goal_mean, goal_std) in goals.items():
        torch.testing.assert_close(goal_mean, (1 - t) * ends[0][name][0] + t * ends[1][name][0])
        torch.testing.assert_close(after[name][0], goal_mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(after[name][1], goal_std, rtol=1e-4, atol=1e-5)
    # the interpolation had collapsed the variance, which REPAIR restores
    assert all(float(before[n][1].mean()) < float(goals[n][1].mean()) for n in goals)
    # at an endpoint the goal is that endpoint's statistics: REPAIR changes nothing
    same = repair(model, ref, goal_statistics(ends, [1.0, 0.0]), points, X)
    assert all(torch.allclose(same[k], ref[k], rtol=1e-4, atol=1e-5) for k in ref)


def test_repair_folds_into_batchnorm_after_a_layer_and_lowers_the_barrier():
    conv_bn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3))
    assert [p.module for p in repair_points(conv_bn, permutation_spec(conv_bn, [1, 8, 8])).values()] == ["1"]
    model, spec, ref, aligned, X, y = _digits_pair([32, 32], epochs=10)
    points = repair_points(model, spec)
    ends = [unit_statistics(model, s, points, X) for s in (ref, aligned)]

    def repaired(state, t):
        return repair(model, state, goal_statistics(ends, [1 - t, t]), points, X)

    loss_fn = make_loss_fn(model, X, y)
    plain = loss_barrier(loss_fn, ref, aligned, n_points=5)
    fixed = loss_barrier(loss_fn, ref, aligned, n_points=5, transform=repaired)
    assert fixed.losses[0] == pytest.approx(plain.losses[0], rel=1e-4)
    assert fixed.barrier < 0.8 * plain.barrier, (plain.barrier, fixed.barrier)  # 0.175 -> 0.121
