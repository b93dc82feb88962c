"""The compiled CPU kernels against the eager torch code they stand in for: the same bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergeflow.merge import sparsify
from mergeflow.merge.registry import TaskOperands, TensorInputs
from mergeflow.merge.sparsify import bernoulli_draws, masked_merge, masked_merge_eager, top_mask, top_of_difference


def _tasks(count: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client tensors and a base with exact zeros, opposite pairs (sums of exactly 0) and repeated values."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=generator, dtype=torch.float64)
    stack = base + torch.randn(count, n, generator=generator, dtype=torch.float64).mul_(0.01)
    stack[:, :50] = base[:50]  # zero task vectors
    stack[1, 50:100] = 2 * base[50:100] - stack[0, 50:100]  # task vectors summing to 0 (ties go to +)
    stack[:, 100:200] = base[100:200] + torch.randint(-2, 3, (count, 100), generator=generator) * 0.25
    return stack, base


@pytest.mark.parametrize("combine", ["sum", "agreeing_sum", "agreeing_mean"])
@pytest.mark.parametrize("divisor", [None, 0.1])
def test_masked_merge_equals_the_eager_code(combine, divisor):
    stack, base = _tasks(4, 6000, 0)
    masks = torch.rand(4, 6000, generator=torch.Generator().manual_seed(1)) < 0.4
    weights = torch.full((4,), 0.25)
    whole = TensorInputs("w", list(stack.view(4, 60, 100)), weights, base.view(60, 100), masks=masks.view(4, 60, 100))
    block = stack[:, :999].contiguous()  # a streamed block: its masks are a column slice of the tensor's
    streamed = TensorInputs("w", list(block), weights, base[:999], stack=block, masks=masks[:, :999])
    for inputs in (whole, streamed):
        compiled = masked_merge(inputs, 0.37, combine, divisor)
        eager = masked_merge_eager(inputs, 0.37, combine, divisor)
        assert compiled.shape == eager.shape
        assert torch.equal(compiled.view(torch.int64), eager.view(torch.int64))  # bits, signed zeros included


def _chunked(x: torch.Tensor, b: torch.Tensor, size: int) -> TaskOperands:
    xs, bs = x.numpy(), b.numpy()
    chunks = lambda: ((s, xs[s : s + size], bs[s : s + size]) for s in range(0, len(xs), size))  # noqa: E731
    return TaskOperands(len(xs), lambda step: (xs[::step].copy(), bs[::step].copy()), chunks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_of_difference_equals_the_eager_selection(dtype):
    generator = torch.Generator().manual_seed(2)
    n = 200_000
    b = torch.randn(n, generator=generator).to(dtype)
    x = (b + torch.randint(-40, 41, (n,), generator=generator) * 0.125).to(dtype)  # many equal magnitudes
    magnitudes = (x.double() - b.double()).abs_()
    for keep in (0, 1, 7, 1000, n // 5, n // 2, n - 1, n):
        expected = top_mask(magnitudes.clone(), keep)
        for operands in (TaskOperands.whole(x, b), _chunked(x, b, 30_001)):
            assert torch.equal(top_of_difference(operands, keep), expected), keep


def test_top_of_difference_when_the_bracket_misses_and_with_nans(monkeypatch):
    """A sample that lies about the rest (every sampled entry large) misses the cut: everything is gathered.
    NaNs, which the compiled comparisons cannot order, get the eager code's order."""
    n = 100_000
    b = torch.zeros(n, dtype=torch.float64)
    x = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    step = n // sparsify._SAMPLE_SIZE
    x[::step] += 10.0
    assert torch.equal(top_of_difference(TaskOperands.whole(x, b), 50_000), top_mask(x.clone(), 50_000))
    x[[5, 17, 99_999]] = float("nan")
    assert torch.equal(top_of_difference(TaskOperands.whole(x, b), 50_000), top_mask(x.abs(), 50_000))


def test_compiled_draws_equal_torch_rand_and_leave_the_same_state():
    """Across MT19937's 624-word refills, from a generator part-way through its stream, with p a number or
    per entry: the same booleans as ``torch.rand(...) < p`` and the same generator state after."""
    assert sparsify._compiled_draws_match()
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
