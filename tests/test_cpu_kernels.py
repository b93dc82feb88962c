"""The compiled CPU kernels against the eager torch code they stand in for: the same bits."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from mergeflow.merge import sparsify
from mergeflow.merge.engine import TaskOperands, TensorInputs
from mergeflow.merge.sparsify import bernoulli_draws, masked_merge, masked_merge_eager, top_mask, top_of_differences


def _tasks(count: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client tensors and a base with exact zeros, opposite pairs (sums of exactly 0) and repeated values."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=generator, dtype=torch.float64)
    stack = base + torch.randn(count, n, generator=generator, dtype=torch.float64).mul_(0.01)
    stack[:, :50] = base[:50]  # zero task vectors
    stack[1, 50:100] = 2 * base[50:100] - stack[0, 50:100]  # task vectors summing to 0 (ties go to +)
    stack[:, 100:200] = base[100:200] + torch.randint(-2, 3, (count, 100), generator=generator) * 0.25
    stack[0, 200], stack[1, 201], stack[2, 202] = float("nan"), float("inf"), float("-inf")
    return stack, base


@pytest.mark.parametrize("combine", ["sum", "agreeing_sum", "agreeing_mean"])
@pytest.mark.parametrize("divisor", [None, 0.1])
def test_masked_merge_equals_the_eager_code(combine, divisor, monkeypatch):
    stack, base = _tasks(4, 6000, 0)
    masks = torch.rand(4, 6000, generator=torch.Generator().manual_seed(1)) < 0.4
    weights = torch.full((4,), 0.25)
    whole = TensorInputs("w", list(stack.view(4, 60, 100)), weights, base.view(60, 100), masks=masks.view(4, 60, 100))
    block = stack[:, :999].contiguous()  # a streamed block: its masks are a column slice of the tensor's
    streamed = TensorInputs("w", list(block), weights, base[:999], stack=block, masks=masks[:, :999])
    # a block as stored (float32, no stack), merged into a given buffer, split between three threads
    out = torch.full((2000,), float("nan"), dtype=torch.float64)
    stored = TensorInputs(
        "w", list(stack[:, :2000].float()), weights, base[:2000].float(), masks=masks[:, :2000], out=out
    )
    monkeypatch.setattr(sparsify, "_MERGE_PER_THREAD", 500)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        merged = [masked_merge(inputs, 0.37, combine, divisor) for inputs in (whole, streamed, stored)]
    finally:
        torch.set_num_threads(threads)
    for inputs, compiled in zip((whole, streamed, stored), merged, strict=True):
        assert inputs.out is None or compiled.data_ptr() == inputs.out.data_ptr()
        eager = masked_merge_eager(inputs, 0.37, combine, divisor)
        assert compiled.shape == eager.shape
        assert torch.equal(compiled.isnan(), eager.isnan())
        numbers = ~eager.isnan()
        assert torch.equal(compiled[numbers].view(torch.int64), eager[numbers].view(torch.int64))  # signed zeros too


def _chunked(tensors: list[torch.Tensor], base: torch.Tensor, size: int) -> TaskOperands:
    """The operands in chunks of ``size``, as a streamed merge reads them."""
    xs, bs = [t.numpy() for t in tensors], base.numpy()
    chunks = lambda ks: ((s, [xs[k][s : s + size] for k in ks], bs[s : s + size]) for s in range(0, len(bs), size))  # noqa: E731
    return TaskOperands(len(xs), len(bs), lambda k, step: (xs[k][::step].copy(), bs[::step].copy()), chunks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_of_differences_equals_the_eager_selection(dtype):
    generator = torch.Generator().manual_seed(2)
    n = 200_000
    b = torch.randn(n, generator=generator).to(dtype)
    xs = [(b + torch.randint(-40, 41, (n,), generator=generator) * 0.125).to(dtype) for _ in range(3)]  # ties
    for keep in (0, 1, 7, 1000, n // 5, n // 2, n - 1, n):
        expected = [top_mask((x.double() - b.double()).abs_(), keep) for x in xs]
        for operands in (TaskOperands.whole(xs, b), _chunked(xs, b, 30_001)):
            masks = torch.from_numpy(top_of_differences(operands, keep))
            assert all(torch.equal(m, e) for m, e in zip(masks, expected, strict=True)), keep


def test_top_of_differences_when_a_bracket_misses_and_with_nans():
    """A sample that lies about the rest (every sampled entry large) misses the cut: everything is gathered.
    NaNs, which the compiled comparisons cannot order, get the eager code's order. Each client alone."""
    n = 100_000
    b = torch.zeros(n, dtype=torch.float64)
    generator = torch.Generator().manual_seed(3)
    honest, lying, with_nans = (torch.rand(n, generator=generator, dtype=torch.float64) for _ in range(3))
    lying[:: n // sparsify._SAMPLE_SIZE] += 10.0
    with_nans[[0, 5, 17, 99_999]] = float("nan")  # index 0 is in the sample: its brackets are NaN
    masks = torch.from_numpy(top_of_differences(_chunked([honest, lying, with_nans], b, 40_000), 50_000))
    for mask, x in zip(masks, (honest, lying, with_nans), strict=True):
        assert torch.equal(mask, top_mask(x.abs(), 50_000))
    # Breadcrumbs' window (drop the top 1,000, keep the next 50,000) with the same clients
    window = torch.from_numpy(top_of_differences(_chunked([honest, lying, with_nans], b, 40_000), 50_000, skip=1000))
    for mask, x in zip(window, (honest, lying, with_nans), strict=True):
        assert torch.equal(mask, top_mask(x.abs(), 51_000) & ~top_mask(x.abs(), 1000))


def test_compiled_draws_equal_torch_rand_and_leave_the_same_state():
    """Across MT19937's 624-word refills, from a generator part-way through its stream, with p a number or
    per entry: the same booleans as ``torch.rand(...) < p`` and the same generator state after."""
    assert sparsify.compiled_draws_match()
    probabilities = torch.rand(5000, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for seed, first, shape, keep in [(0, 0, (5000,), 0.3), (2**40 + 7, 311, (50, 100), probabilities.view(50, 100)),
                                     (5, 1, (313,), 0.9), (6, 624, (1,), 0.5)]:  # fmt: skip
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        torch.rand(first, dtype=torch.float64, generator=ours)
        torch.rand(first, dtype=torch.float64, generator=theirs)
        drawn = bernoulli_draws(shape, keep, ours)
        assert drawn.shape == shape
        assert torch.equal(drawn, torch.rand(shape, dtype=torch.float64, generator=theirs) < keep)
        assert torch.equal(ours.get_state(), theirs.get_state())
        assert torch.equal(torch.rand(3, generator=ours), torch.rand(3, generator=theirs))
    assert np.isclose(
        bernoulli_draws((100_000,), 0.3, torch.Generator().manual_seed(1)).double().mean(), 0.3, atol=0.01
    )


def test_draws_split_between_threads_equal_one_run(monkeypatch):
    """Each thread skips to its share of the stream; the booleans and the state after are one run's."""
    monkeypatch.setattr(sparsify, "_DRAWS_PER_THREAD", 1000)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for first, shape in [(0, (3, 4001)), (623, (2, 5000)), (5, (624 * 7 + 1,))]:
            ours, theirs = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
            torch.rand(first, dtype=torch.float64, generator=ours)
            torch.rand(first, dtype=torch.float64, generator=theirs)
            drawn = bernoulli_draws(shape, 0.25, ours)
            assert torch.equal(drawn, torch.rand(shape, dtype=torch.float64, generator=theirs) < 0.25)
            assert torch.equal(ours.get_state(), theirs.get_state())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_windows_of_differences_equal_two_eager_selections(dtype):
    """Breadcrumbs' window, ranks ``skip`` to ``skip + keep − 1``, in one pass with two brackets, equals
    ``top(skip + keep) & ~top(skip)`` of the eager code, ties included; so do the edge cases and the
    brackets that overlap (a narrow window), which take two passes."""
    generator = torch.Generator().manual_seed(5)
    n = 150_000
    b = torch.randn(n, generator=generator).to(dtype)
    xs = [(b + torch.randint(-60, 61, (n,), generator=generator) * 0.0625).to(dtype) for _ in range(3)]
    magnitudes = [(x.double() - b.double()).abs_() for x in xs]
    for skip, keep in [(1500, 30_000), (1, 1), (10, 0), (100, n), (n // 2, n - n // 2), (40_000, 20), (n - 1, 1)]:
        expected = [top_mask(m.clone(), min(skip + keep, n)) & ~top_mask(m.clone(), skip) for m in magnitudes]
        for operands in (TaskOperands.whole(xs, b), _chunked(xs, b, 20_011)):
            masks = torch.from_numpy(top_of_differences(operands, keep, skip=skip))
            assert all(torch.equal(m, e) for m, e in zip(masks, expected, strict=True)), (skip, keep)


@pytest.mark.parametrize("upper", [False, True])
def test_split_counts_marks_and_gathers_like_numpy_whatever_the_room(upper):
    """One pass of the selection over a chunk that spans several tiles and ends in a short one: its counts,
    its marks and the gathered (value, index) pairs, with room for all of them, exactly all, or fewer."""
    from mergeflow.merge import cpu_kernels

    generator = np.random.default_rng(0)
    x, b = generator.standard_normal(10_007).astype(np.float32), generator.standard_normal(10_007).astype(np.float32)
    values = np.abs(x.astype(np.float64) - b.astype(np.float64))
    ordered = np.sort(values)
    bracket = (float(ordered[6000]), float(ordered[6400]))
    top = (float(ordered[9800]), float(ordered[9900])) if upper else None
    inside = (values >= bracket[0]) & (values <= bracket[1])
    inside_top = (values >= top[0]) & (values <= top[1]) if upper else np.zeros_like(inside)
    expected_mask = values > bracket[1]
    if upper:
        expected_mask &= ~(values > top[1])
    for room in (int(inside.sum()) + 5, int(inside.sum()), 17):
        upper_room = int(inside_top.sum()) if upper else 0
        gathered = (np.empty(room), np.empty(room, np.int64), np.empty(upper_room), np.empty(upper_room, np.int64))
        mask = np.empty(len(x), bool)
        counts = cpu_kernels.split(x, b, bracket, top, mask, gathered, (0, 0), 100)
        above = int((values > bracket[1]).sum())
        assert counts == (above, int(inside.sum()), int((values > top[1]).sum()) if upper else 0, upper_room, 0)
        assert np.array_equal(mask, expected_mask)
        fits = min(room, int(inside.sum()))
        assert np.array_equal(gathered[0][:fits], values[inside][:fits])
        assert np.array_equal(gathered[1][:fits], 100 + np.flatnonzero(inside)[:fits])
        assert np.array_equal(gathered[2], values[inside_top]) and np.array_equal(
            gathered[3], 100 + np.flatnonzero(inside_top)
        )


@pytest.mark.parametrize("kind", ["spread", "few values", "subnormal", "zeros and inf", "one value", "short"])
def test_a_cut_marks_the_wanted_largest_equal_ones_by_lower_index(kind):
    """``finish`` (the cut found by radix steps on the magnitudes' bits) marks what a stable sort would: the
    ``wanted`` largest gathered values, those equal at the cut in index order, at every ``wanted``."""
    from mergeflow.merge import cpu_kernels

    generator = np.random.default_rng(3)
    size = 40 if kind == "short" else 30_000
    values = {
        "spread": generator.uniform(0.01, 0.0100001, size),
        "few values": generator.integers(0, 6, size) * 0.125,
        "subnormal": np.abs(generator.standard_normal(size)) * 1e-310,
        "zeros and inf": np.where(generator.random(size) < 0.3, 0.0, generator.random(size)),
        "one value": np.full(size, 0.25),
        "short": generator.random(size),
    }[kind]
    if kind == "zeros and inf":
        values[generator.choice(size, 5, replace=False)] = np.inf
    indices = np.sort(generator.choice(3 * size, size, replace=False))
    for wanted in (1, 2, size // 3, size // 2 + 1, size - 1, size):
        mask = np.zeros(3 * size, bool)
        cpu_kernels.finish(mask, values, indices, wanted)
        expected = np.zeros(3 * size, bool)
        expected[indices[np.lexsort((indices, -values))[:wanted]]] = True
        assert np.array_equal(mask, expected), (kind, wanted)


def test_loading_the_kernels_leaves_scipy_linalg_to_whoever_calls_blas():
    """numba's array registry would import ``scipy.linalg`` (0.2 s) to probe for BLAS; the kernels load
    without it, and numba still finds BLAS for a function that calls it (imported then)."""
    code = """
import sys
import numba, numpy as np
from mergeflow.merge import sparsify
assert sparsify.compiled_draws_match()  # a kernel loaded and run
assert "scipy.linalg" not in sys.modules, "loading the kernels imported scipy.linalg"
from numba.np import arraymath, linalg
assert arraymath._HAVE_BLAS and arraymath.ensure_blas is linalg.ensure_blas

@numba.njit
def convolve_and_dot(a, b):
    return np.convolve(a, b), np.dot(a, b)

convolved, dot = convolve_and_dot(np.arange(3.0), np.ones(3))
assert convolved.tolist() == [0.0, 1.0, 3.0, 3.0, 2.0] and dot == 3.0
assert "scipy.linalg" in sys.modules
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


_MISSES = """
import numba, torch
from mergeflow.merge import cpu_kernels, merge
from mergeflow.merge.warm import _stand_ins
for method, count, dtype in (("ties", 5, torch.float32), ("della", 3, torch.bfloat16), ("dare_ties", 8, torch.float64)):
    base, clients = _stand_ins(dtype, count)
    merge(method, clients, base=base)
kernels = [getattr(cpu_kernels, name) for name in dir(cpu_kernels)]
print(sum(sum(k.stats.cache_misses.values()) for k in kernels if isinstance(k, numba.core.registry.CPUDispatcher)))
"""


def test_after_the_install_step_a_first_merge_of_up_to_8_clients_compiles_nothing():
    """``python -m mergeflow.merge.warm`` (``make install`` runs it; here it loads what that compiled, or compiles
    anew after an edit to the kernels) leaves no kernel for a later process to compile, whatever K ≤ 8 and dtype."""
    warm = subprocess.run([sys.executable, "-m", "mergeflow.merge.warm"], capture_output=True, text=True, check=True)
    assert "the CPU merge kernels are compiled" in warm.stdout
    misses = subprocess.run([sys.executable, "-c", _MISSES], capture_output=True, text=True, check=True)
    assert misses.stdout.split() == ["0"]
