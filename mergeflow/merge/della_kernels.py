"""Compiled CPU kernels for DELLA: each row ranked, drawn and pruned in cache, and the K clients merged.

The eager code (``mergeflow.merge.della``) sorts every row of every task vector with a stable
``argsort`` to rank its magnitudes, which dominated DELLA's time. Here a row's magnitudes are counted
into about 2 × width linear buckets (exact zeros in a bucket of their own) and scattered, which leaves
them almost sorted, and an insertion sort finishes the order (equal ones stay in index order). A row
whose buckets are too full (a skewed row) or that holds a NaN or an infinity is ordered by a stable
merge sort instead. Entries are then visited in that order, so each one's rank is its position: its
probability ``p = low + rank · step``, its uniform and its pruned value follow without a rank array.

``merge`` prunes a block of rows of all K clients, each from its own position in the stream, and
combines them while they are in cache; ``prune`` writes the pruned task vectors out (for mergekit's
``l1`` rescale, which needs each whole vector's norm first). The same uniforms of the same MT19937
stream and the same float64 operations in the same order as the eager code: the same bits
(``tests/test_della_kernels.py``).
"""

from __future__ import annotations

import numba
import numpy as np

from mergeflow.merge.cpu_kernels import _combine, _temper_all, draw

NONE, PROBABILITY = 0, 1  # rescale: none (mergekit's l1 is applied afterwards) or by 1/p

_WIDEST = 32  # entries a bucket of non-zero magnitudes may hold before its row is merge-sorted instead
_BLOCK = 4096  # elements of each client pruned before the block is merged: K such rows stay in L2

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


@_jit
def merge(
    xs, base, width, step, low, rescale, states, positions, first, last, coefficient, combine, out
):  # pragma: no cover
    """``out = base + coefficient · combine_k(pruned_k)`` for rows ``first:last`` of the tensor (``rows =
    n // width`` rows of ``width``), ``combine`` and ``out``'s dtype as ``cpu_kernels.masked_merge``'s.

    ``xs`` (a tuple) are the K clients' flat tensors and ``base`` the base's (float32 or float64, widened
    here). Client k's draws come from ``states[k]`` and ``positions[k]`` (``cpu_kernels.draw``), set to
    its row ``first``'s first uniform and advanced in place; pruning as ``prune``."""
    count = len(xs)
    per_block = max(1, _BLOCK // width)
    tile = np.empty((count, per_block * width))
    total, sign = np.empty(per_block * width), np.empty(per_block * width)
    kept, agreeing = np.empty(per_block * width), np.empty(per_block * width)
    scratch = _scratch(width)
    tempered = np.empty((count, 624), dtype=np.uint32)
    for k in range(count):
        _temper_all(states[k], tempered[k])
    for row in range(first, last, per_block):
        rows = min(last, row + per_block) - row
        size = rows * width
        for k in range(count):
            for r in range(rows):
                at = (row + r) * width
                _prune_row(xs[k][at : at + width], base[at : at + width], step, low, rescale, states[k], tempered[k],
                           positions[k], scratch, tile[k, r * width : (r + 1) * width])  # fmt: skip
        _combine(tile, size, combine, total, sign, kept, agreeing)
        at = row * width
        for j in range(size):
            out[at + j] = np.float64(base[at + j]) + coefficient * total[j]


@_jit
def prune(xs, base, width, step, low, rescale, state, position, first, last, tasks):  # pragma: no cover - compiled
    """DELLA's pruned task vectors of stream rows ``first:last`` into ``tasks`` (float64, ``K · n``).

    The stream is the K clients' rows one client after another (row g is client ``g // rows``'s row
    ``g % rows``), as the eager code draws them. Each entry of task ``t = x − base`` gets
    ``p = low + rank · step`` (its rank by magnitude in its row, equal ones by index) and its uniform
    ``u``; it is kept where ``u < p``, as ``t · keep``, divided by ``p`` with ``rescale``
    ``PROBABILITY``. ``state`` and ``position`` are the generator at row ``first``'s first uniform."""
    rows = base.shape[0] // width
    scratch = _scratch(width)
    tempered = np.empty(624, dtype=np.uint32)
    _temper_all(state, tempered)
    for g in range(first, last):
        at = (g % rows) * width
        _prune_row(xs[g // rows][at : at + width], base[at : at + width], step, low, rescale, state, tempered,
                   position, scratch, tasks[g * width : (g + 1) * width])  # fmt: skip


@numba.njit(inline="always", error_model="numpy")
def _scratch(width):  # pragma: no cover - compiled
    """``_prune_row``'s working arrays for rows of ``width``: bucket counts (about 2 × width buckets, a power
    of two), keys, order, ordered sizes, sizes, task and uniforms."""
    buckets = 2
    while buckets < 2 * width:
        buckets *= 2
    counts, keys, order = np.empty(buckets + 1, np.int64), np.empty(width, np.int64), np.empty(width, np.int64)
    return counts, keys, order, np.empty(width), np.empty(width), np.empty(width), np.empty(width)


@numba.njit(inline="always", error_model="numpy")
def _prune_row(x, b, step, low, rescale, state, tempered, position, scratch, out):  # pragma: no cover - compiled
    """One row's pruned task vector into ``out``, its uniforms drawn in index order (``prune``)."""
    counts, keys, order, ordered, sizes, task, uniform = scratch
    width = x.shape[0]
    unordered = 0
    for j in range(width):
        difference = np.float64(x[j]) - np.float64(b[j])
        task[j], sizes[j] = difference, abs(difference)
        unordered += np.int64(not abs(difference) < np.inf)  # NaN or ±inf
    draw(state, tempered, position, uniform)
    if step == 0.0:  # one probability for all
        for j in range(width):
            kept = task[j] * (1.0 if uniform[j] < low else 0.0)
            out[j] = kept / low if rescale == PROBABILITY else kept
        return
    if unordered or not _bucket_order(sizes, counts, keys, order, ordered):
        _sort_order(sizes, order)
    ranks = keys  # the keys are spent: their room takes each entry's rank
    for rank in range(width):
        ranks[order[rank]] = rank
    for j in range(width):  # in index order and branch-free, so that it vectorizes
        p = ranks[j] * step + low
        kept = task[j] * (1.0 if uniform[j] < p else 0.0)
        out[j] = kept / p if rescale == PROBABILITY else kept


@numba.njit(inline="always", error_model="numpy")
def _bucket_order(sizes, counts, keys, order, ordered):  # pragma: no cover - compiled
    """The stable ascending order of a row's finite ``sizes`` into ``order`` (and the sizes so ordered into
    ``ordered``): counted and scattered into buckets (0 for exact zeros, then ``len(counts) − 1`` of equal
    width up to the largest), then insertion-sorted. False, with ``order`` undone, when a bucket other
    than the zeros' holds more than ``_WIDEST`` (the insertion sort could take too long)."""
    width, buckets = sizes.shape[0], counts.shape[0] - 1
    largest = _largest(sizes)
    scale = (buckets - 0.5) / largest if largest > 0 else 0.0  # below ``buckets`` even at the largest
    if not scale < np.inf:  # a subnormal largest
        return False
    counts[:] = 0
    for j in range(width):
        size = sizes[j]
        key = 0 if size == 0.0 else 1 + np.int64(size * scale)
        keys[j] = key
        counts[key] += 1
    widest, start = 0, counts[0]
    counts[0] = 0
    for b in range(1, buckets + 1):  # counts[b] becomes bucket b's start, the sum kept in a register
        count = counts[b]
        widest = max(widest, count)
        counts[b] = start
        start += count
    if widest > _WIDEST:
        return False
    for j in range(width):
        b = keys[j]
        where = counts[b]
        counts[b] = where + 1
        order[where], ordered[where] = j, sizes[j]
    for q in range(1, width):  # equal sizes never move past each other: index order stays among them
        size = ordered[q]
        if ordered[q - 1] <= size:
            continue
        j, before = order[q], q - 1
        while before >= 0 and ordered[before] > size:
            ordered[before + 1], order[before + 1] = ordered[before], order[before]
            before -= 1
        ordered[before + 1], order[before + 1] = size, j
    return True


@numba.njit(inline="always", error_model="numpy")
def _largest(sizes):  # pragma: no cover - compiled
    """The largest of non-negative finite ``sizes``, on four chains (one chain waits on every comparison)."""
    a = b = c = d = 0.0
    width = sizes.shape[0]
    for j in range(0, width - 3, 4):
        a = sizes[j] if sizes[j] > a else a
        b = sizes[j + 1] if sizes[j + 1] > b else b
        c = sizes[j + 2] if sizes[j + 2] > c else c
        d = sizes[j + 3] if sizes[j + 3] > d else d
    for j in range(width - width % 4, width):
        a = sizes[j] if sizes[j] > a else a
    return max(max(a, b), max(c, d))


@numba.njit(inline="always", error_model="numpy")
def _sort_order(sizes, order):  # pragma: no cover - compiled
    """The stable ascending order of ``sizes`` into ``order``, NaNs last (as torch's ``argsort``): the bit
    patterns of non-negative doubles order as their values, every NaN made the same."""
    bits = sizes.view(np.uint64).copy()
    for j in range(bits.shape[0]):
        if sizes[j] != sizes[j]:
            bits[j] = np.uint64(0x7FF8000000000000)
    order[:] = np.argsort(bits, kind="mergesort")
