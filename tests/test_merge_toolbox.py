"""TIES, DARE, SLERP and Model Stock: closed forms worked by hand, and PEFT's own implementation."""

from __future__ import annotations

import math

import pytest
import torch

from mergeflow.errors import MergeflowError
from mergeflow.merge import merge
from mergeflow.merge.model_stock import stock_ratio
from mergeflow.merge.sparsify import disjoint_mean, dropout_masks, magnitude_masks


def _states(*vectors, base=None):
    return [{"w": torch.tensor(v, dtype=torch.float64)} for v in vectors]


def test_ties_trims_elects_and_takes_the_disjoint_mean_worked_by_hand():
    base = {"w": torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)}
    tasks = [[1.0, -2.0, 0.5, 3.0], [2.0, 1.5, -1.0, -0.5], [-3.0, 1.0, 0.2, 2.0]]
    states = [{"w": base["w"] + torch.tensor(t, dtype=torch.float64)} for t in tasks]
    # density 0.5 keeps two entries each: [0,-2,0,3], [2,1.5,0,0], [-3,0,0,2]; sums -1, -0.5, 0, 5 elect
    # signs -,-,+,+; the agreeing entries' means are -3, -2, (none) 0, (3+2)/2.
    merged = merge("ties", states, base=base, density=0.5, scaling=0.5)["w"]
    torch.testing.assert_close(merged, base["w"] + 0.5 * torch.tensor([-3.0, -2.0, 0.0, 2.5], dtype=torch.float64))


def test_dare_without_drops_is_task_arithmetic_seeded_and_unbiased():
    generator = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(40, generator=generator, dtype=torch.float64)}
    states = [{"w": base["w"] + torch.randn(40, generator=generator, dtype=torch.float64)} for _ in range(3)]
    arithmetic = merge("task_arithmetic", states, base=base, scaling=0.7)["w"]
    torch.testing.assert_close(merge("dare_linear", states, base=base, drop_rate=0.0, scaling=0.7)["w"], arithmetic)
    once = merge("dare_linear", states, base=base, drop_rate=0.6, scaling=0.7, seed=5)["w"]
    torch.testing.assert_close(merge("dare_linear", states, base=base, drop_rate=0.6, scaling=0.7, seed=5)["w"], once)
    assert not torch.equal(merge("dare_linear", states, base=base, drop_rate=0.6, scaling=0.7, seed=6)["w"], once)
    draws = torch.stack(
        [merge("dare_linear", states, base=base, drop_rate=0.6, scaling=0.7, seed=s)["w"] for s in range(2000)]
    )
    spread = draws.std(dim=0) / math.sqrt(len(draws))
    assert ((draws.mean(dim=0) - arithmetic).abs() < 4 * spread + 1e-12).all()


def test_slerp_interpolates_on_the_sphere_and_takes_two_models_only():
    a, b = {"w": torch.tensor([1.0, 0.0], dtype=torch.float64)}, {"w": torch.tensor([0.0, 1.0], dtype=torch.float64)}
    half = merge("slerp", [a, b], t=0.5)["w"]
    torch.testing.assert_close(half, torch.tensor([1.0, 1.0], dtype=torch.float64) / math.sqrt(2))
    torch.testing.assert_close(merge("slerp", [a, b], t=0.0)["w"], a["w"])
    torch.testing.assert_close(merge("slerp", [a, b], t=1.0)["w"], b["w"])
    near = {"w": torch.tensor([1.0, 1e-3], dtype=torch.float64)}  # nearly parallel: linear
    torch.testing.assert_close(merge("slerp", [a, near], t=0.25)["w"], 0.75 * a["w"] + 0.25 * near["w"])
    with pytest.raises(MergeflowError, match="exactly two models, got 3"):
        merge("slerp", [a, b, a])


def test_model_stock_ratio_in_closed_form():
    def ratio(*vectors: torch.Tensor) -> float:
        rows = torch.stack(vectors)
        return stock_ratio(rows @ rows.T)

    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    assert ratio(e1, e2) == pytest.approx(0.0)  # orthogonal: back to the base
    assert ratio(e1, 2 * e1) == pytest.approx(1.0)  # parallel: the average
    sixty = torch.tensor([0.5, math.sqrt(3) / 2])
    assert ratio(e1, sixty) == pytest.approx(2 / 3)  # 2·½ / (1 + ½)
    base = {"w": torch.tensor([1.0, 1.0], dtype=torch.float64)}
    states = [{"w": base["w"] + e1.double()}, {"w": base["w"] + sixty.double()}]
    expected = 2 / 3 * (states[0]["w"] + states[1]["w"]) / 2 + 1 / 3 * base["w"]
    torch.testing.assert_close(merge("model_stock", states, base=base)["w"], expected)


def test_ties_and_dare_equal_peft_merge_utils():
    merge_utils = pytest.importorskip("peft.utils.merge_utils", reason="PEFT is the reference implementation")
    generator = torch.Generator().manual_seed(1)
    tasks = [torch.randn(6, 9, generator=generator, dtype=torch.float64) for _ in range(3)]
    ones = torch.ones(3, dtype=torch.float64)
    trimmed = torch.stack(tasks) * torch.stack(list(magnitude_masks([t.clone() for t in tasks], 0.3)))
    torch.testing.assert_close(disjoint_mean(trimmed), merge_utils.ties(tasks, ones, density=0.3), rtol=0, atol=1e-12)
    for name, combine in (("dare_linear", lambda t: t.sum(dim=0)), ("dare_ties", disjoint_mean)):
        torch.manual_seed(7)
        reference = getattr(merge_utils, name)(tasks, ones, density=0.4)
        drops = dropout_masks(3, (6, 9), 0.6, torch.Generator().manual_seed(7))
        ours = combine(torch.stack(tasks) * torch.stack(list(drops)) / 0.4)
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-12)


def test_greedy_soup_adds_a_client_only_when_the_held_out_score_does_not_drop():
    from mergeflow.merge import run_merge

    states = [{"w": torch.tensor([float(k)], dtype=torch.float64)} for k in range(4)]
    # best single model 1 (or 2, the tie goes to the first); adding 2 reaches the optimum 1.5, 0 and 3 hurt
    result = run_merge("greedy_soup", states, scorer=lambda s: -abs(float(s["w"]) - 1.5))
    torch.testing.assert_close(result.state["w"], torch.tensor([1.5], dtype=torch.float64))
    assert result.summary == {"soup_size": 2.0, "soup_score": 0.0}
    assert result.curves["soup_score_tried"] == [-0.5, 0.0, -0.5, -0.5]
    with pytest.raises(MergeflowError, match="needs scorer"):
        run_merge("greedy_soup", states)


def test_regmean_on_linear_regressions_is_pooled_least_squares():
    from mergeflow.grams import linear_input_grams

    generator = torch.Generator().manual_seed(3)
    truth = torch.randn(2, 5, generator=generator, dtype=torch.float64)
    states, grams, xs, ys = [], [], [], []
    for rows, shift in ((40, 0.0), (25, 2.0), (60, -1.0)):  # clients with different input distributions
        x = torch.randn(rows, 5, generator=generator, dtype=torch.float64) + shift
        y = x @ truth.T + 0.3 * torch.randn(rows, 2, generator=generator, dtype=torch.float64)
        layer = torch.nn.Linear(5, 2, bias=False).double()
        layer.weight.data = torch.linalg.lstsq(x, y).solution.T  # the client's own least squares
        states.append({"weight": layer.weight.detach().clone()})
        grams.append(linear_input_grams(layer, x, batch_size=16))
        xs.append(x)
        ys.append(y)
    pooled = torch.linalg.lstsq(torch.cat(xs), torch.cat(ys)).solution.T
    merged = merge("regmean", states, grams=grams, alpha=1.0)["weight"]
    torch.testing.assert_close(merged, pooled, rtol=0, atol=1e-8)
    shrunk = merge("regmean", states, grams=grams)["weight"]  # α = 0.9 regularises: close, not equal
    assert 0 < (shrunk - pooled).abs().max() < 0.5
    with pytest.raises(MergeflowError, match="needs grams"):
        merge("regmean", states)


def test_grams_are_permuted_like_the_layer_inputs():
    from mergeflow.align import apply_permutation, permutation_spec, random_permutation
    from mergeflow.align.permute import permute_grams
    from mergeflow.grams import linear_input_grams

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    spec = permutation_spec(model, [4])
    perms = random_permutation(spec, 1)
    x = torch.randn(30, 4)
    permuted_model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    permuted_model.load_state_dict(apply_permutation(spec, model.state_dict(), perms))
    expected = linear_input_grams(permuted_model, x)
    moved = permute_grams(spec, linear_input_grams(model, x), perms)
    assert moved.keys() == expected.keys() == {"0.weight", "2.weight"}
    for key in expected:
        torch.testing.assert_close(moved[key], expected[key])


def test_radix_selection_finds_the_same_cut_as_kthvalue(monkeypatch):
    import mergeflow.merge.sparsify as sparsify

    monkeypatch.setattr(sparsify, "_RADIX_BLOCK", 1000)  # several blocks per tensor
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(5000, generator=generator, dtype=torch.float64).abs_()
    values[:300] = 0.25  # a run of ties
    values[300:600] = 0.0  # and zeros (unchanged entries of a task vector)
    values[600] = 1e300
    values[601] = 1e-300
    monkeypatch.setattr(sparsify, "_RADIX_FROM", 1)
    # all 64 bits by radix passes (gathering below 1 entry: never), or gathering below 200 sharing entries
    for threshold in (1, 200):
        monkeypatch.setattr(sparsify, "_GATHER_BELOW", threshold)
        for k in (1, 2, 150, 299, 2500, 4400, 4700, 4999, 5000):
            assert sparsify.kth_largest(values, k) == values.kthvalue(5000 - k + 1).values, (threshold, k)
    with pytest.raises(ValueError, match="outside"):
        sparsify.kth_largest(values, 5001)
    monkeypatch.setattr(sparsify, "_RADIX_FROM", 1)
    # the masks then keep exactly int(density * numel) entries, ties to the lower index, as before
    tasks = [torch.randn(4000, generator=generator, dtype=torch.float64).round(decimals=1) for _ in range(3)]
    radix = list(magnitude_masks([t.clone() for t in tasks], 0.3))
    monkeypatch.setattr(sparsify, "_RADIX_FROM", 1 << 30)
    assert all(torch.equal(a, b) for a, b in zip(radix, magnitude_masks([t.clone() for t in tasks], 0.3), strict=True))
    assert all(int(mask.sum()) == 1200 for mask in radix)
