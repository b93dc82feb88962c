"""Task-vector sparsification and sign election, shared by TIES and DARE.

Semantics follow the papers and PEFT's ``merge_utils`` (checked against it in the tests): trimming
keeps ``int(density * numel)`` entries per tensor, the elected sign is that of the summed task
vectors (ties go to +), and the disjoint mean averages only the non-zero entries that agree with it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import torch

from mergeflow.merge.sums import running_sum

# From this many entries on, the cut is found by radix selection in blocks, not ``kthvalue``.
_RADIX_FROM = 1 << 22
_RADIX_BLOCK = 1 << 20
_GATHER_BELOW = 1 << 18  # entries sharing the bits found so far, gathered for ``kthvalue`` (2 MiB)


def magnitude_masks(tasks: Iterable[torch.Tensor], density: float) -> Iterator[torch.Tensor]:
    """TIES' trim: for each task vector in turn, a mask of its ``int(density * numel)`` largest magnitudes.

    Equal magnitudes at the cut go to the lower index (``topk``, which PEFT and mergekit use, leaves
    that order unspecified). Each task vector is overwritten with its magnitudes; a boolean mask and,
    for a large tensor, block-sized selection temporaries are all that is added.
    """
    for task in tasks:
        magnitudes = task.reshape(-1).abs_()
        count = magnitudes.numel()
        keep = min(int(density * count), count)
        if keep in (0, count):
            yield torch.full(task.shape, keep > 0, dtype=torch.bool)
            continue
        cut = kth_largest(magnitudes, keep)
        kept = magnitudes > cut
        short = keep - int(kept.sum())
        if short:
            kept[(magnitudes == cut).nonzero().view(-1)[:short]] = True
        yield kept.view(task.shape)


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
    if count < _RADIX_FROM or values.dtype != torch.float64:
        return values.kthvalue(count - k + 1).values
    bits = values.view(torch.int64)
    prefix, known, rank = 0, 0, k  # the high bits found so far, and k's rank among the entries sharing them

    def sharing_prefix(block: torch.Tensor) -> torch.Tensor:
        return block[(block >> (64 - known)) == prefix] if known else block

    while True:
        counts = torch.zeros(1 << 16, dtype=torch.int64)
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
        return torch.tensor([prefix], dtype=torch.int64).view(torch.float64)[0]
    survivors = torch.cat([sharing_prefix(bits[s : s + _RADIX_BLOCK]) for s in range(0, count, _RADIX_BLOCK)])
    return survivors.view(torch.float64).kthvalue(sharing - rank + 1).values


def dropout_masks(count: int, shape: tuple[int, ...], drop_rate: float, generator: torch.Generator):
    """DARE's drops: ``count`` masks that keep each entry with probability 1 − ``drop_rate``, drawn one task
    vector after another from ``generator`` (as PEFT's ``random_pruning`` with the same seed)."""
    for _ in range(count):
        if drop_rate == 0:
            yield torch.ones(shape, dtype=torch.bool)
        else:
            yield torch.bernoulli(torch.full(shape, 1.0 - drop_rate, dtype=torch.float64), generator=generator).bool()


def disjoint_mean(tasks: torch.Tensor) -> torch.Tensor:
    """TIES' elect-and-merge: the mean of the entries whose sign agrees with the sign of their sum.

    Elementwise, and accumulated one task vector at a time in order, so a block of elements gives the
    same numbers as the whole tensor.
    """
    positive = running_sum(tasks) >= 0
    total = torch.zeros_like(tasks[0])
    count = torch.zeros_like(tasks[0])
    for task in tasks:
        agree = torch.where(positive, task > 0, task < 0)
        total.add_(task * agree)
        count.add_(agree)
    return total.div_(count.clamp_(min=1))


def tensor_generator(seed: int, name: str) -> torch.Generator:
    """A generator seeded by ``seed`` and the tensor's name: the same draws in memory, streamed, in any order."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
