"""Task-vector sparsification and sign election, shared by TIES and DARE.

Semantics follow the papers and PEFT's ``merge_utils`` (checked against it in the tests): trimming
keeps ``int(density * numel)`` entries per tensor, the elected sign is that of the summed task
vectors (ties go to +), and the disjoint mean averages only the non-zero entries that agree with it.
"""

from __future__ import annotations

import hashlib

import torch


def trim_by_magnitude(tasks: torch.Tensor, density: float) -> torch.Tensor:
    """Keep each task vector's ``int(density * numel)`` largest-magnitude entries (``tasks``: ``(K, ...)``).

    Trims ``tasks`` in place and returns it; one task vector at a time, so the temporaries are one
    vector's size, not K of them.
    """
    if density >= 1:
        return tasks
    flat = tasks.view(tasks.shape[0], -1)
    keep = int(density * flat.shape[1])
    for row in flat:
        kept = torch.zeros(row.shape, dtype=torch.bool)
        if keep:
            kept[row.abs().topk(keep).indices] = True
        row.masked_fill_(~kept, 0.0)
    return tasks


def drop_and_rescale(tasks: torch.Tensor, drop_rate: float, generator: torch.Generator) -> torch.Tensor:
    """DARE: zero each entry with probability ``drop_rate`` and rescale the rest by ``1 / (1 - drop_rate)``,
    one Bernoulli draw per task vector in order (as PEFT's ``random_pruning`` with the same seed).

    Works in place on ``tasks`` and returns it.
    """
    if drop_rate == 0:
        return tasks
    keep = 1.0 - drop_rate
    for task in tasks:
        task.mul_(torch.bernoulli(torch.full_like(task, keep), generator=generator)).div_(keep)
    return tasks


def disjoint_mean(tasks: torch.Tensor) -> torch.Tensor:
    """TIES' elect-and-merge: the mean of the entries whose sign agrees with the sign of their sum.

    Accumulated one task vector at a time (no ``(K, ...)`` temporaries).
    """
    positive = tasks.sum(dim=0) >= 0
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
