"""Breadcrumbs and DELLA worked by hand, the selection behind TIES against a plain sort, and every
sparsifying merge making its tensors on its inputs' device."""

from __future__ import annotations

import pytest
import torch

from mergeflow.errors import ConfigError
from mergeflow.merge import merge, sparsify
from mergeflow.merge.della import keep_probabilities, pruned
from mergeflow.merge.engine import TaskVectors
from mergeflow.merge.sparsify import agreeing_sum, magnitude_masks, outlier_masks, top_mask, top_masks
from mergeflow.schema.merge import DellaOptions, validate_options


def _states(*vectors):
    return [{"w": torch.tensor(v, dtype=torch.float64)} for v in vectors]


def test_breadcrumbs_drops_the_outliers_and_the_smallest_worked_by_hand():
    # 10 entries, gamma 0.1: the largest magnitude (index 3) goes; density 0.4 keeps the next four
    task = torch.tensor([0.5, -0.1, 0.9, -5.0, 0.2, -0.7, 0.05, 0.3, -0.6, 0.0], dtype=torch.float64)
    (mask,) = outlier_masks([task.clone()], density=0.4, gamma=0.1)
    assert mask.nonzero().view(-1).tolist() == [0, 2, 5, 8]
    # gamma 0: plain top-density; equal magnitudes at the cut go to the lower index
    (mask,) = outlier_masks([torch.tensor([1.0, -2.0, 1.0, 1.0])], density=0.5, gamma=0.0)
    assert mask.tolist() == [True, True, False, False]

    base = {"w": torch.zeros(4, dtype=torch.float64)}
    states = _states([4.0, 1.0, -2.0, 0.5], [-3.0, 2.0, 1.0, -0.25])  # density 0.5, gamma 0.25: ranks 1-2 kept
    # client 0 keeps -2.0 and 1.0, client 1 keeps 2.0 and 1.0 (its outlier -3.0 and smallest -0.25 go)
    linear = merge("breadcrumbs", states, base=base, density=0.5, gamma=0.25, scaling=2.0)["w"]
    assert linear.tolist() == [0.0, 2.0 * (1.0 + 2.0), 2.0 * (-2.0 + 1.0), 0.0]
    mean = merge("breadcrumbs", states, base=base, density=0.5, gamma=0.25, normalize=True)["w"]
    assert mean.tolist() == [0.0, 1.5, -0.5, 0.0]
    # TIES: entry 2 sums to -1 < 0, so only -2.0 agrees; mergekit's default sums the agreeing entries
    ties = merge("breadcrumbs_ties", states, base=base, density=0.5, gamma=0.25)["w"]
    assert ties.tolist() == [0.0, 3.0, -2.0, 0.0]
    disjoint = merge("breadcrumbs_ties", states, base=base, density=0.5, gamma=0.25, normalize=True)["w"]
    assert disjoint.tolist() == [0.0, 1.5, -2.0, 0.0]


def test_top_mask_and_the_sign_election_equal_a_plain_sort_with_ties_and_zeros(monkeypatch):
    import mergeflow.merge.sparsify as sparsify

    monkeypatch.setattr(sparsify, "_SAMPLE_FROM", 1000)  # the sampled bracket on small tensors
    monkeypatch.setattr(sparsify, "_SAMPLE_SIZE", 64)
    generator = torch.Generator().manual_seed(0)
    for values in (
        torch.randn(20_000, generator=generator, dtype=torch.float64).abs_(),
        torch.randn(20_000, generator=generator, dtype=torch.float64).round(decimals=1).abs_(),  # many ties
        torch.cat([torch.zeros(15_000, dtype=torch.float64), torch.rand(5000, generator=generator).double()]),
    ):
        order = sorted(range(values.numel()), key=lambda i: (-float(values[i]), i))
        for keep in (1, 7, 2000, 4999, 5000, 5001, 19_999):
            expected = torch.zeros(values.numel(), dtype=torch.bool)
            expected[order[:keep]] = True
            assert torch.equal(top_mask(values, keep), expected), keep

    tasks = torch.randn(4, 1000, generator=generator, dtype=torch.float64).round(decimals=1)
    total, count = agreeing_sum(tasks)
    positive = tasks.sum(0) >= 0
    agree = torch.where(positive, tasks > 0, tasks < 0)
    torch.testing.assert_close(total, (tasks * agree).sum(0), rtol=0, atol=1e-12)
    assert torch.equal(count, agree.sum(0).double())
    assert not torch.signbit(total[count == 0]).any()  # an empty sum is +0, as the disjoint mean always gave


def test_della_keep_probabilities_by_rank_per_row_worked_by_hand():
    matrix = torch.tensor([[3.0, -1.0, 2.0], [0.0, -4.0, 4.0]], dtype=torch.float64)
    probabilities = keep_probabilities(matrix, density=0.5, epsilon=0.2)
    # row 0: |-1| smallest -> 0.3, 2 -> 0.5, 3 largest -> 0.7; row 1: equal magnitudes ranked by index
    torch.testing.assert_close(probabilities, torch.tensor([[0.7, 0.3, 0.5], [0.3, 0.5, 0.7]], dtype=torch.float64))
    vector = keep_probabilities(torch.tensor([1.0, -3.0, 2.0, 0.5, 4.0], dtype=torch.float64), 0.4, 0.1)
    torch.testing.assert_close(vector, torch.tensor([0.35, 0.45, 0.4, 0.3, 0.5], dtype=torch.float64))  # one row
    kernel = torch.arange(2 * 2 * 3, dtype=torch.float64).view(2, 2, 3)  # conv rows: one per output channel
    spread = keep_probabilities(kernel, 0.5, 0.25).view(2, -1)
    torch.testing.assert_close(spread[0], torch.linspace(0.25, 0.75, 6, dtype=torch.float64))
    torch.testing.assert_close(spread[1], spread[0])
    assert torch.equal(
        keep_probabilities(torch.ones(3, 1, dtype=torch.float64), 0.6, 0.1),
        torch.full((3, 1), 0.6, dtype=torch.float64),
    )


def test_della_prunes_by_those_probabilities_rescales_and_merges(monkeypatch):
    import mergeflow.merge.della as della

    generator = torch.Generator().manual_seed(1)
    tasks = torch.randn(2, 8, 50, generator=generator, dtype=torch.float64)
    options = DellaOptions(density=0.4, epsilon=0.3, seed=3)
    once = pruned(tasks, options, "w")
    assert torch.equal(once, pruned(tasks, options, "w"))  # seeded
    monkeypatch.setattr(della, "_ROW_CHUNK", 120)  # rows drawn two at a time: the same draws on the CPU
    assert torch.equal(once, pruned(tasks, options, "w"))
    assert not torch.equal(once, pruned(tasks, options.model_copy(update={"seed": 4}), "w"))
    kept = once != 0
    probabilities = torch.stack([keep_probabilities(t, 0.4, 0.3) for t in tasks])
    torch.testing.assert_close(once[kept], (tasks / probabilities)[kept], rtol=0, atol=0)
    # large magnitudes survive more often: the kept fraction of each row's top third beats its bottom third
    ranks = tasks.abs().argsort(-1).argsort(-1)
    assert kept[ranks >= 34].double().mean() > kept[ranks < 16].double().mean() + 0.3
    # unbiased: averaged over seeds the pruned vectors approach the task vectors
    draws = torch.stack([pruned(tasks, options.model_copy(update={"seed": s}), "w") for s in range(400)]).mean(0)
    assert float((draws - tasks).abs().max()) < 0.35 * float(tasks.abs().max())
    l1 = pruned(tasks, options.model_copy(update={"rescale": "l1"}), "w")
    torch.testing.assert_close(l1.abs().sum((1, 2)), tasks.abs().sum((1, 2)))  # mergekit 0.1.5's rescale
    assert torch.equal(pruned(tasks, options.model_copy(update={"rescale": "none"}), "w") != 0, kept)

    base = {"w": torch.zeros(3, dtype=torch.float64)}
    states = _states([1.0, -2.0, 3.0], [2.0, 1.0, -1.0])
    # density 1, epsilon 0: nothing dropped, nothing rescaled: task arithmetic and TIES without the trim
    torch.testing.assert_close(
        merge("della_linear", states, base=base, density=1.0, epsilon=0.0, scaling=0.5)["w"],
        torch.tensor([1.5, -0.5, 1.0], dtype=torch.float64),
    )
    torch.testing.assert_close(
        merge("della", states, base=base, density=1.0, epsilon=0.0)["w"],
        torch.tensor([1.5, -2.0, 3.0], dtype=torch.float64),
    )


@pytest.mark.parametrize(
    ("method", "options", "key"),
    [
        ("breadcrumbs", {"density": 0.0}, "density"),
        ("breadcrumbs", {"density": 0.9, "gamma": 0.2}, "gamma"),
        ("breadcrumbs_ties", {"gamma": 1.0}, "gamma"),
        ("della", {"density": 0.3, "epsilon": 0.3}, "epsilon"),
        ("della_linear", {"density": 0.8, "epsilon": 0.3}, "epsilon"),
        ("della", {"epsilon": -0.1}, "epsilon"),
        ("della", {"density": 1.5}, "density"),
    ],
)
def test_out_of_range_options_name_their_key(method, options, key):
    with pytest.raises(ConfigError, match=rf"merge\.options\.{method}\.{key}"):
        validate_options(method, options)


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("ties", {"density": 0.3}),
        ("dare_linear", {"drop_rate": 0.5}),
        ("dare_ties", {"drop_rate": 0.5}),
        ("breadcrumbs", {"density": 0.3, "gamma": 0.1}),
        ("breadcrumbs_ties", {"density": 0.3, "gamma": 0.1}),
        ("della", {"density": 0.5, "epsilon": 0.2}),
        ("della_linear", {"density": 0.5, "epsilon": 0.2, "rescale": "l1"}),
    ],
)
def test_sparsifying_merges_make_every_tensor_on_their_inputs_device(method, options, monkeypatch):
    """With ``meta`` as the default device, a tensor made without the inputs' device lands on ``meta`` and
    mixing it with the CPU inputs fails; a generator made without their device is a CPU one here, so the
    draws' generator is checked to be made on the inputs' device."""
    import mergeflow.merge.sparsify as sparsify

    monkeypatch.setattr(sparsify, "_SAMPLE_FROM", 100)  # the bracketed selection too
    monkeypatch.setattr(sparsify, "_SAMPLE_SIZE", 32)
    generator = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(20, 30, generator=generator), "b": torch.randn(30, generator=generator)}
    states = [{k: v + torch.randn(v.shape, generator=generator) for k, v in base.items()} for _ in range(3)]
    expected = merge(method, states, base=base, **options)
    devices = []
    made = torch.Generator

    def generator_on(*args, **kwargs):  # a generator must be asked for on a device, never by default
        devices.append(kwargs.get("device", args[0] if args else None))
        return made(*args, **kwargs)

    # undone before the comparisons: assert_close's first call imports torch.distributed.tensor, which
    # reads torch.Generator as a type
    with monkeypatch.context() as patched, torch.device("meta"):
        patched.setattr(torch, "Generator", generator_on)
        merged = merge(method, states, base=base, **options)
    assert all(device is not None and torch.device(device).type == "cpu" for device in devices)
    assert bool(devices) == (method.startswith(("dare", "della")))
    for key, value in expected.items():
        assert merged[key].device.type == "cpu"
        torch.testing.assert_close(merged[key], value, rtol=0, atol=0)


def test_radix_selection_makes_its_tensors_on_the_values_device(monkeypatch):
    import mergeflow.merge.sparsify as sparsify

    monkeypatch.setattr(sparsify, "_SAMPLE_FROM", 1 << 30)
    monkeypatch.setattr(sparsify, "_RADIX_FROM", 1)
    monkeypatch.setattr(sparsify, "_GATHER_BELOW", 1)  # all 64 bits by radix passes
    values = torch.randn(3000, generator=torch.Generator().manual_seed(0), dtype=torch.float64).abs_()
    expected = values.kthvalue(3000 - 100 + 1).values
    with torch.device("meta"):
        assert sparsify.kth_largest(values, 100) == expected


def _ragged_magnitudes(rows: int, count: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(count)
    values = torch.randn(rows, count, generator=generator, dtype=torch.float64).abs()
    values[1, : count // 2] = 0.5  # a value repeated across half a row
    values[2] = values[2].round(decimals=1)  # many equal values at any cut
    values[3] = 0.0  # an all-zero task vector
    return values


@pytest.mark.parametrize("count", [100, 70_000, 300_000])
@pytest.mark.parametrize("fraction", [0.0001, 0.2, 0.5, 0.999])
def test_top_masks_of_all_rows_at_once_equal_each_rows_top_mask(count, fraction):
    """The batched selection (what TIES and Breadcrumbs use on a GPU) picks exactly what row-by-row does:
    small tensors through ``kthvalue``, large ones through the shared bracket, ties at the cut by index."""
    values = _ragged_magnitudes(4, count)
    keep = int(fraction * count)
    together = top_masks(values.clone(), keep)
    assert torch.equal(together, torch.stack([top_mask(row.clone(), keep) for row in values]))
    assert together.sum(1).tolist() == [keep] * 4


def test_rows_whose_bracket_misses_are_selected_alone(monkeypatch):
    values = _ragged_magnitudes(4, 80_000)
    expected = torch.stack([top_mask(row.clone(), 20_000) for row in values])
    monkeypatch.setattr(sparsify, "_bracket_ranks", lambda size, count, k: (1, 2))  # brackets the top two only
    assert torch.equal(top_masks(values.clone(), 20_000), expected)


def test_masks_from_task_vectors_together_equal_those_drawn_one_at_a_time():
    """``TaskVectors.together`` (K vectors in memory on an accelerator) takes the batched path: a ``meta``
    device on the vectors forces it here on CPU data. TIES' and Breadcrumbs' masks are the same."""
    generator = torch.Generator().manual_seed(1)
    vectors = torch.randn(3, 300, 256, generator=generator, dtype=torch.float64)
    one_at_a_time = TaskVectors(3, lambda k: vectors[k].clone())
    together = TaskVectors(3, lambda k: vectors[k].clone(), "meta", together=vectors.clone)
    for masks in (lambda t: magnitude_masks(t, 0.3), lambda t: outlier_masks(t, density=0.3, gamma=0.05)):
        assert all(torch.equal(a, b) for a, b in zip(masks(together), masks(one_at_a_time), strict=True))
