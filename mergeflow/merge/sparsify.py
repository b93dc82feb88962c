"""Task-vector sparsification and sign election, shared by TIES and DARE.

Semantics follow the papers and PEFT's ``merge_utils`` (checked against it in the tests): trimming
keeps ``int(density * numel)`` entries per tensor, the elected sign is that of the summed task
vectors (ties go to +), and the disjoint mean averages only the non-zero entries that agree with it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator

import torch

from mergeflow.merge.sums import running_sum

# From this many entries on, the cut is found by radix selection in blocks, not ``kthvalue``.
_RADIX_FROM = 1 << 22
_RADIX_BLOCK = 1 << 20
_GATHER_BELOW = 1 << 18  # entries sharing the bits found so far, gathered for ``kthvalue`` (2 MiB)
# From this many entries on, the cut is first bracketed between two values of an evenly spaced sample.
_SAMPLE_FROM = 1 << 16
_SAMPLE_SIZE = 1 << 14


def magnitude_masks(tasks: Iterable[torch.Tensor], density: float) -> Iterator[torch.Tensor]:
    """TIES' trim: for each task vector in turn, a mask of its ``int(density * numel)`` largest magnitudes.

    Equal magnitudes at the cut go to the lower index (``topk``, which PEFT and mergekit use, leaves
    that order unspecified). Each task vector is overwritten with its magnitudes; a boolean mask and,
    for a large tensor, block-sized selection temporaries are all that is added.
    """
    for task in tasks:
        magnitudes = task.reshape(-1).abs_()
        yield top_mask(magnitudes, min(int(density * magnitudes.numel()), magnitudes.numel())).view(task.shape)


def outlier_masks(tasks: Iterable[torch.Tensor], density: float, gamma: float) -> Iterator[torch.Tensor]:
    """Model Breadcrumbs' masks: for each task vector in turn, drop its ``int(gamma * numel)`` largest
    magnitudes and keep the next ``int(density * numel)`` (mergekit's ``magnitude_outliers``).

    Magnitudes ordered as in ``magnitude_masks`` (equal ones by index), so the kept entries are ranks
    ``[n_top, n_top + n_keep)`` of one order. The task vectors are overwritten with their magnitudes.
    """
    for task in tasks:
        magnitudes = task.reshape(-1).abs_()
        count = magnitudes.numel()
        top = min(int(gamma * count), count)
        kept = min(int(density * count), count - top)
        mask = top_mask(magnitudes, top + kept)
        if top:
            mask &= ~top_mask(magnitudes, top)
        yield mask.view(task.shape)


def top_mask(magnitudes: torch.Tensor, keep: int) -> torch.Tensor:
    """A mask of the ``keep`` largest of a 1-D tensor of non-negative values, equal values to the lower index.

    Everything at or above the ``keep``-th largest value is kept; only when that value repeats across the
    cut (rare for real task vectors) are the surplus equal entries at the highest indices dropped.
    """
    count = magnitudes.numel()
    if keep <= 0 or keep >= count:
        return torch.full((count,), keep > 0, dtype=torch.bool, device=magnitudes.device)
    found = _bracketed_cut(magnitudes, keep) if count >= _SAMPLE_FROM else None
    cut = found[0] if found is not None else kth_largest(magnitudes, keep)
    kept = magnitudes >= cut
    reaching = found[1] if found is not None else int(torch.count_nonzero(kept))
    if reaching > keep:
        kept[(magnitudes == cut).nonzero().view(-1)[keep - reaching :]] = False
    return kept


def kth_largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k``-th largest of a 1-D tensor of non-negative values (1 ≤ ``k`` ≤ numel), exactly.

    ``kthvalue`` sorts a copy with its indices: twice the tensor again (590 MiB for GPT-2's float64
    embedding, 2 GB for a 7B model's). A large float64 tensor is instead searched by its bit
    patterns, which order non-negative doubles as their values: 16 bits at a time, counting block by
    block the entries that share the bits found so far, until few enough share them (256k) to gather
    those and finish with ``kthvalue``.
    """
    count = values.numel()
    if not 1 <= k <= count:
        raise ValueError(f"k = {k} is outside 1..{count}")
    found = _bracketed_cut(values, k) if count >= _SAMPLE_FROM else None
    if found is not None:
        return found[0]
    if count < _RADIX_FROM or values.dtype != torch.float64:
        return kth_smallest(values, count - k + 1)
    bits = values.view(torch.int64)
    prefix, known, rank = 0, 0, k  # the high bits found so far, and k's rank among the entries sharing them

    def sharing_prefix(block: torch.Tensor) -> torch.Tensor:
        return block[(block >> (64 - known)) == prefix] if known else block

    while True:
        counts = torch.zeros(1 << 16, dtype=torch.int64, device=values.device)
        for start in range(0, count, _RADIX_BLOCK):
            block = sharing_prefix(bits[start : start + _RADIX_BLOCK])
            counts += torch.bincount((block >> (48 - known)) & 0xFFFF, minlength=1 << 16)
        from_top = counts.flip(0).cumsum(0)  # entries at or above each digit, the largest digit first
        position = int(torch.searchsorted(from_top, rank))
        rank -= int(from_top[position - 1]) if position else 0
        digit = (1 << 16) - 1 - position
        prefix, known = (prefix << 16) | digit, known + 16
        sharing = int(counts[digit])
        if known == 64 or sharing < _GATHER_BELOW:
            break
    if known == 64:
        return torch.tensor([prefix], dtype=torch.int64, device=values.device).view(torch.float64)[0]
    survivors = torch.cat([sharing_prefix(bits[s : s + _RADIX_BLOCK]) for s in range(0, count, _RADIX_BLOCK)])
    return kth_smallest(survivors.view(torch.float64), sharing - rank + 1)


def kth_smallest(values: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k``-th smallest of a 1-D tensor: ``kthvalue`` on the CPU, a sort on an accelerator, where
    ``kthvalue`` selects a whole slice in one block of threads (8.3 ms against a sort's 0.3 ms for 1.5M
    doubles on an H200, docs/benchmarks.md). The same value either way."""
    if values.device.type == "cpu":
        return values.kthvalue(k).values
    return values.sort().values[k - 1]


def _bracketed_cut(values: torch.Tensor, k: int) -> tuple[torch.Tensor, int] | None:
    """The ``k``-th largest found between two values of an evenly spaced sample, and how many entries are
    at least that large; None when the bracket misses it (then the caller selects over everything).

    A sample of 16k entries puts the k-th largest between two of its order statistics a few standard
    deviations either side of k's sample rank. Counting the entries above the bracket and gathering
    those inside it (a few percent of the tensor) leaves a small ``kthvalue``: two comparisons over the
    tensor instead of ``kthvalue``'s sorted copy with indices, and the count at the cut comes from the
    gathered entries, not from another pass.
    """
    count = values.numel()
    sample = values[:: max(1, count // _SAMPLE_SIZE)]
    size = sample.numel()
    expected = k * size / count  # k's rank from the top within the sample
    margin = 4.0 * math.sqrt(expected * (1.0 - k / count)) + 4.0
    high_rank, low_rank = max(1, int(expected - margin)), min(size, int(expected + margin) + 1)
    ordered = sample.sort(descending=True).values
    high, low = ordered[high_rank - 1], ordered[low_rank - 1]
    between = values >= low
    reaching = int(torch.count_nonzero(between))  # entries at or above the bracket's low end
    if high_rank > 1:  # else the bracket is open above
        between.logical_and_(values <= high)
    inside = values[between.nonzero().view(-1)]  # indices then a gather: faster than a boolean select
    above = reaching - inside.numel()
    if not above < k <= reaching:
        return None
    cut = kth_smallest(inside, inside.numel() - (k - above) + 1)
    return cut, above + int(torch.count_nonzero(inside >= cut))


def dropout_masks(
    count: int, shape: tuple[int, ...], drop_rate: float, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """DARE's drops: ``count`` masks that keep each entry with probability 1 − ``drop_rate``, drawn one task
    vector after another from ``generator`` (as PEFT's ``random_pruning`` with the same seed), on the
    generator's device (``bernoulli_draws``)."""
    device = generator.device
    for _ in range(count):
        if drop_rate == 0:
            yield torch.ones(shape, dtype=torch.bool, device=device)
        else:
            yield bernoulli_draws(shape, 1.0 - drop_rate, generator)


def bernoulli_draws(shape: tuple[int, ...], keep: float | torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Booleans, each True with probability ``keep`` (a number, or a float64 tensor of ``shape``), on the
    generator's device.

    A float64 uniform below ``keep``: on the CPU the same draws, bit for bit, and the same generator state
    after, as ``torch.bernoulli`` of a float64 tensor of probabilities (both compare one 53-bit uniform
    per entry with p), in half its time and without the tensor of probabilities.
    """
    return torch.rand(shape, dtype=torch.float64, device=generator.device, generator=generator) < keep


def disjoint_mean(tasks: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """TIES' elect-and-merge: the mean of the entries whose sign agrees with the sign of their sum.

    Elementwise, and accumulated one task vector at a time in order, so a block of elements gives the
    same numbers as the whole tensor. ``overwrite``: ``tasks`` may be overwritten (``agreeing_sum``).
    """
    total, count = agreeing_sum(tasks, overwrite)
    return total.div_(count.clamp_(min=1))


def agreeing_sum(tasks: torch.Tensor, overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of the entries whose sign agrees with that of their column's sum (ties go to +), and
    their number, summed one task vector at a time in order.

    The task vectors are multiplied by the elected sign (±1, exact), so that agreeing means positive:
    three operations over the ``(K, ...)`` stack and K − 1 additions, instead of selecting by both
    signs vector by vector. ``overwrite``: flip ``tasks`` in place instead of a ``(K, ...)`` copy.
    """
    negative = running_sum(tasks) < 0
    sign = torch.ones_like(tasks[0]).masked_fill_(negative, -1.0)
    flipped = tasks.mul_(sign) if overwrite else tasks * sign
    count = (flipped > 0).sum(0).to(tasks.dtype)
    total = running_sum(flipped.clamp_(min=0))
    # the sum of the flipped agreeing entries, flipped back; + 0.0 makes an empty sum +0 as before, not −0
    return total.mul_(sign).add_(0.0), count


def tensor_generator(seed: int, name: str, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` seeded by ``seed`` and the tensor's name: the same draws in memory, streamed,
    in any order. Draws are made where the data is (a CUDA generator for CUDA tensors, so nothing moves),
    so they are reproducible on one kind of device but differ between the CPU and a GPU."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
