"""DELLA (Deep et al. 2024): drop task-vector entries with probabilities ranked by magnitude, rescale the rest.

As mergekit's ``della`` (TIES' sign election and disjoint mean of the pruned vectors) and
``della_linear`` (their sum). Each row of a task vector ranks its entries by magnitude; the keep
probability rises evenly from ``density − ε`` (smallest) to ``density + ε`` (largest), and a kept entry
is divided by its probability (``rescale``). Rows are of the whole tensor and ``1/p`` differs per entry,
so these methods are not elementwise: a streamed merge takes each such tensor whole (the K clients'
copies of one tensor at a time), not in blocks. On the CPU a compiled kernel
(``mergeflow.merge.cpu_kernels``) ranks, draws and prunes each row in one pass, straight from the
tensors as stored, and the merge step combines the pruned vectors in another, with the eager code's
bits; every other device runs the eager code.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from mergeflow.merge.engine import TensorInputs
from mergeflow.merge.sparsify import (
    bernoulli_draws,
    compiled_draws_match,
    disjoint_mean,
    in_threads,
    kernel_operands,
    kernels,
    stream_state,
    tensor_generator,
    thread_shares,
)
from mergeflow.merge.sums import running_sum
from mergeflow.schema.merge import DellaOptions

_ROW_CHUNK = 1 << 20  # entries of whole rows ranked and drawn at a time: bounds the temporaries
_PER_THREAD = 1 << 17  # elements (of each client) a thread prunes and merges, at least, when a tensor is split
_COMPILED_WIDEST = (1 << 31) - 1  # entries a row may have for the compiled kernel, which orders them in int32


def keep_probabilities(task: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """Each entry's keep probability, shaped like ``task``: per row, by the rank of its magnitude.

    Rows: a 1-D (or 0-D) tensor is one row, as in mergekit; a matrix's rows are its rows; a conv
    kernel ``(out, in, ...)`` has one row per output channel (mergekit ranks along dim 1 instead). The
    smallest magnitude of a row gets ``density − epsilon``, the largest ``density + epsilon``, evenly
    spaced by rank; equal magnitudes are ranked by index. A row of one entry gets ``density``.
    """
    return _row_probabilities(_rows(task), density, epsilon).view(task.shape)


def _rows(task: torch.Tensor) -> torch.Tensor:
    return task.reshape(1, -1) if task.dim() < 2 else task.reshape(task.shape[0], -1)


def _row_probabilities(rows: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    width = rows.shape[1]
    if width == 1:
        return torch.full_like(rows, density)
    order = rows.abs().argsort(dim=1, stable=True)
    steps = torch.arange(width, dtype=rows.dtype, device=rows.device).mul_(2.0 * epsilon / (width - 1))
    return torch.empty_like(rows).scatter_(1, order, steps.expand_as(rows)).add_(density - epsilon)


def prune_(tasks: torch.Tensor, options: DellaOptions, name: str) -> torch.Tensor:
    """DELLA's drops and rescaling of the ``(K, ...)`` task vectors, in place (and returned).

    Drawn client after client, a chunk of whole rows at a time, from a generator on their device seeded
    by ``seed`` and the tensor's name; temporaries stay a few chunks' size whatever the tensor's.
    """
    if tasks.numel() == 0:  # nothing to draw (and no rows to reshape into)
        return tasks
    generator = tensor_generator(options.seed, name, tasks.device)
    tasks = tasks.contiguous()  # so that each row chunk is a view
    for task in tasks:
        rows = _rows(task)
        before = task.abs().sum() if options.rescale == "l1" else None
        step = max(1, _ROW_CHUNK // max(1, rows.shape[1]))
        for start in range(0, rows.shape[0], step):
            chunk = rows[start : start + step]
            probabilities = _row_probabilities(chunk, options.density, options.epsilon)
            chunk.mul_(bernoulli_draws(chunk.shape, probabilities, generator))
            if options.rescale == "probability":
                chunk.div_(probabilities)
        if before is not None:
            _to_l1_norm(task, before)
    return tasks


def pruned(tasks: torch.Tensor, options: DellaOptions, name: str) -> torch.Tensor:
    """The ``(K, ...)`` task vectors after DELLA's drops and rescaling, as a new tensor (``prune_``)."""
    return prune_(tasks.clone(), options, name)


def _pruned_tasks(x: TensorInputs, options: DellaOptions) -> torch.Tensor:
    assert x.base is not None  # needs base (schema)
    return prune_(x.stacked().to(torch.float64) - x.base.to(torch.float64), options, x.name)


def _merged(x: TensorInputs, options: DellaOptions, combine: str) -> torch.Tensor:
    assert x.base is not None  # needs base (schema)
    if x.base.device.type == "cpu" and _row_width(x.base) <= _COMPILED_WIDEST and compiled_draws_match():
        return _compiled(x, options, combine)
    tasks = _pruned_tasks(x, options)
    combined = disjoint_mean(tasks, overwrite=True) if combine == "agreeing_mean" else running_sum(tasks)
    return x.base.to(torch.float64) + options.scaling * combined


def _compiled(x: TensorInputs, options: DellaOptions, combine: str) -> torch.Tensor:
    """``_merged`` on the CPU by the compiled kernels (``mergeflow.merge.cpu_kernels``), from the tensors as
    given (float32 or float64), into ``x.out`` if given. The tensor's rows are split between threads, each
    with its own K streams, skipped to its first row: every client's rows of a block are pruned and merged
    at once. With ``rescale: l1``, ``_compiled_l1``."""
    assert x.base is not None
    cpu_kernels = kernels()
    xs, base, out = kernel_operands(x)
    count, n = len(xs), base.shape[0]
    if n == 0:
        return out
    width = _row_width(x.base)
    step = 2.0 * options.epsilon / (width - 1) if width > 1 else 0.0  # as _row_probabilities
    low = options.density - options.epsilon if width > 1 else options.density
    words, position = stream_state(tensor_generator(options.seed, x.name, x.base.device))
    code, flat = getattr(cpu_kernels, combine.upper()), out.view(-1).numpy()
    if options.rescale == "l1":
        size = count * (n // width) * -(-width // 8)  # bytes of packed keep flags, every row from a byte
        bits = x.working(-(-size // 8)).view(torch.uint8)[:size].numpy()
        _compiled_l1(xs, base, width, (step, low), (words, position), options.scaling, code, flat, bits)
        return out
    rescale = cpu_kernels.RESCALE_PROBABILITY if options.rescale == "probability" else cpu_kernels.RESCALE_NONE
    per_thread = max(1, _PER_THREAD // width)  # rows
    slots = cpu_kernels.padded(xs)

    def merge(rows: tuple[int, int]) -> None:
        states, positions = np.empty((count, 624), np.uint32), np.empty((count, 2), np.int64)
        state, at = words.copy(), position.copy()
        cpu_kernels.skip(state, at, 2 * rows[0] * width)
        for k in range(count):  # client k's first uniform here is k·n + rows[0]·width
            states[k], positions[k] = state, at
            if k + 1 < count:
                cpu_kernels.skip(state, at, 2 * n)
        cpu_kernels.della_merge(
            slots, base, width, step, low, rescale, states, positions, *rows, options.scaling, code, flat
        )

    in_threads(merge, thread_shares(n // width, per_thread))
    return out


def _compiled_l1(
    xs: tuple[np.ndarray, ...],
    base: np.ndarray,
    width: int,
    ranking: tuple[float, float],
    stream: tuple[np.ndarray, np.ndarray],
    coefficient: float,
    code: int,
    flat: np.ndarray,
    bits: np.ndarray,
) -> None:
    """mergekit's ``l1`` rescale in two compiled passes over the stored tensors, into ``flat``: the first draws
    every client's keep flags into ``bits`` (packed, a bit an entry, where a float64 copy of the pruned task
    vectors took 64) and each row's L1 norms before and after the drops; the second unpacks a block of rows at
    a time and merges the kept entries scaled by their client's before/after (``_to_l1_norm``). The norms are
    summed along each row, then over the rows in order (the same bits at any thread count), not in torch's
    order: the merge agrees with the eager code's to rounding, not bit for bit."""
    cpu_kernels = kernels()
    count, rows = len(xs), base.shape[0] // width
    bits, norms = bits.reshape(count * rows, -1), np.empty((count * rows, 2))
    slots, words, position = cpu_kernels.padded(xs), *stream
    block = max(1, _PER_THREAD // width)  # rows

    def prune(share: tuple[int, int]) -> None:
        state, at = words.copy(), position.copy()
        cpu_kernels.skip(state, at, 2 * share[0] * width)  # two words a uniform
        cpu_kernels.della_keep(slots, base, width, *ranking, state, at, *share, bits, norms)

    in_threads(prune, thread_shares(count * rows, block))
    before, after = norms.reshape(count, rows, 2).sum(axis=1).T
    scales = np.where((before >= 1e-7) & (after >= 1e-7), before / np.where(after > 0, after, 1.0), 1.0)
    clients = bits.reshape(count, rows, -1)

    def merge(share: tuple[int, int]) -> None:
        for first in range(share[0], share[1], block):
            last = min(share[1], first + block)
            masks = np.unpackbits(clients[:, first:last], axis=-1, count=width).reshape(count, -1).view(np.bool_)
            at, end = first * width, last * width
            cpu_kernels.masked_merge(tuple(x[at:end] for x in slots), base[at:end], masks, scales, 0.0, coefficient,
                                     code, flat[at:end], 0, end - at)  # fmt: skip

    in_threads(merge, thread_shares(rows, block))


def _row_width(tensor: torch.Tensor) -> int:
    """Entries in each of the tensor's rows (``_rows``)."""
    return math.prod(tensor.shape[1:]) if tensor.dim() >= 2 else tensor.numel()


def _to_l1_norm(task: torch.Tensor, before: torch.Tensor) -> None:
    """mergekit 0.1.5's rescale: the pruned ``task`` scaled in place to the L1 norm ``before`` it had unpruned."""
    after = task.abs().sum()
    if before >= 1e-7 and after >= 1e-7:  # mergekit's guard against tiny norms
        task.mul_(before / after)


def della(x: TensorInputs, options: DellaOptions) -> torch.Tensor:
    """DELLA: base + λ · disjoint mean of the magnitude-ranked, randomly pruned, rescaled, sign-elected task vectors."""
    return _merged(x, options, "agreeing_mean")


def della_linear(x: TensorInputs, options: DellaOptions) -> torch.Tensor:
    """DELLA + task arithmetic: base + λ · Σ_k of the magnitude-ranked, randomly pruned, rescaled task vectors."""
    return _merged(x, options, "sum")
