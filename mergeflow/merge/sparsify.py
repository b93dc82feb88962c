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


def magnitude_masks(tasks: Iterable[torch.Tensor], density: float) -> Iterator[torch.Tensor]:
    """TIES' trim: for each task vector in turn, a mask of its ``int(density * numel)`` largest magnitudes.

    Equal magnitudes at the cut go to the lower index (``topk``, which PEFT and mergekit use, leaves
    that order unspecified). Each task vector is overwritten with its magnitudes: one selection
    (``kthvalue``) and a boolean mask are the only temporaries.
    """
    for task in tasks:
        magnitudes = task.reshape(-1).abs_()
        count = magnitudes.numel()
        keep = min(int(density * count), count)
        if keep in (0, count):
            yield torch.full(task.shape, keep > 0, dtype=torch.bool)
            continue
        cut = magnitudes.kthvalue(count - keep + 1).values  # the keep-th largest magnitude
        kept = magnitudes > cut
        short = keep - int(kept.sum())
        if short:
            kept[(magnitudes == cut).nonzero().view(-1)[:short]] = True
        yield kept.view(task.shape)


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
