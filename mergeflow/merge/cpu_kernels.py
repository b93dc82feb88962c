"""Compiled CPU kernels for the sparsifying merges: one pass where eager torch makes a dozen.

TIES, DARE, Breadcrumbs and DELLA spend their time in short elementwise chains (less the base, mask,
elect, sum, scale) and in selections and draws over whole task vectors. As eager torch ops each
chain is a pass over memory per op; compiled with numba each is one loop over the elements. Every
kernel does the same IEEE float64 operations in the same order as the torch code it stands in for
(``mergeflow.merge.sparsify``, ``mergeflow.merge.della``), so the results are the same bit for bit
(a NaN's sign and payload aside: which operand's NaN an addition keeps is the compiler's choice);
the tests hold each against that code. numba compiles without fast-math, so no operation is fused
or reordered. Kernels are compiled on first use and cached beside this file.

Every kernel lives in this one file: numba invalidates a cached kernel when its own file changes, not
when a function it inlined from another file does, so a kernel in a second file would keep running
the old code of any helper here after an edit.

Only the CPU uses these; an accelerator runs the torch code.
"""

from __future__ import annotations

import importlib.util
import sys

import numba
import numpy as np


def _load_numba_arrays_without_scipy() -> None:
    """Load numba's array registry without importing ``scipy.linalg``, which it imports (0.2 s, 8% of a
    DELLA merge of 124M parameters) only to learn whether ``np.correlate`` and ``np.convolve`` may call BLAS.
    These kernels call neither. The probe answers from whether SciPy is installed instead; numba then
    behaves as it would have: a function that calls BLAS imports and checks it when it is compiled."""
    if "numba.np.arraymath" in sys.modules:  # loaded already: nothing left to save
        return
    from numba.np import linalg

    probe = getattr(linalg, "ensure_blas", None)
    if probe is None:  # a numba without this probe
        return

    def absent() -> None:
        raise ImportError

    linalg.ensure_blas = absent
    try:
        from numba.np import arraymath
    finally:
        linalg.ensure_blas = probe
    if getattr(arraymath, "ensure_blas", None) is absent:
        arraymath.ensure_blas = probe
    if hasattr(arraymath, "_HAVE_BLAS"):
        arraymath._HAVE_BLAS = importlib.util.find_spec("scipy") is not None


_load_numba_arrays_without_scipy()
_jit = numba.njit(cache=True, nogil=True, error_model="numpy")

SUM, AGREEING_SUM, AGREEING_MEAN = 0, 1, 2  # how ``masked_merge`` combines the K masked task vectors

_FEWEST_SLOTS = 8  # the client tuples' smallest padded length: K = 1…8 share one compiled kernel


def padded(xs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """The K clients' arrays padded (with the first again) to 8, 16, 32, … entries, for the kernels that take
    them as a tuple: numba compiles a kernel once per tuple length, so without padding every new K compiled
    for 3 to 7 s; now K = 1…8 run the kernels compiled at install (``mergeflow.merge.warm``). The kernels read
    K from the masks or the streams, never from the tuple."""
    slots = _FEWEST_SLOTS
    while slots < len(xs):
        slots *= 2
    return xs + (xs[0],) * (slots - len(xs))


_TILE = 256  # elements merged at a time: the K clients' task vectors of a tile stay in L1 between the two passes


@_jit
def masked_merge(xs, base, masks, scales, divisor, coefficient, combine, out, start, end):  # pragma: no cover
    """``out = base + coefficient · combine_k((x_k − base) · mask_k · scale_k / divisor)`` over elements
    ``start:end``, for K 1-D client arrays ``xs`` (a tuple, ``padded``; float32 or float64, widened to float64
    here), the base, ``(K, n)`` boolean ``masks`` and ``(K,)`` float64 ``scales`` (1: exact, no change to a
    bit) (``divisor`` 0: no division); ``out`` float64, or float32 (each float64 result rounded once as it is
    stored).

    ``combine``: ``SUM`` (in order k = 0..K−1), ``AGREEING_SUM`` (the entries whose sign agrees with their
    sum's, ties to +, as ``sparsify.agreeing_sum``) or ``AGREEING_MEAN`` (that sum over their number, at
    least 1: TIES' disjoint mean). A tile at a time, client by client, so that each inner loop is
    over elements and vectorizes; every element's sums still run k = 0..K−1.
    """
    count = masks.shape[0]
    tasks = np.empty((count, _TILE))
    total, sign, kept, agreeing = np.empty(_TILE), np.empty(_TILE), np.empty(_TILE), np.empty(_TILE)
    for first in range(start, end, _TILE):
        size = min(end, first + _TILE) - first
        b = base[first : first + size]
        for k in range(count):
            x, m, task, scale = xs[k][first : first + size], masks[k, first : first + size], tasks[k], scales[k]
            for j in range(size):
                task[j] = _masked(np.float64(x[j]), np.float64(b[j]), m[j], scale, divisor)
        _combine(tasks, size, combine, total, sign, kept, agreeing)
        merged = out[first : first + size]  # a slice indexed from 0: the loop vectorizes (``draw``)
        for j in range(size):
            merged[j] = np.float64(b[j]) + coefficient * total[j]


@numba.njit(inline="always", error_model="numpy")
def _combine(tasks, size, combine, total, sign, kept, agreeing):  # pragma: no cover - compiled
    """``total[:size] = combine_k(tasks[k, :size])`` (``masked_merge``'s ``combine``), every element's sums
    in order k = 0..K−1; ``sign``, ``kept`` and ``agreeing`` are scratch."""
    count = tasks.shape[0]
    total[:size] = tasks[0, :size]
    for k in range(1, count):
        task = tasks[k]
        for j in range(size):
            total[j] += task[j]
    if combine != SUM:
        for j in range(size):
            sign[j] = -1.0 if total[j] < 0 else 1.0
            agreeing[j] = 0.0
        for k in range(count):
            task = tasks[k]
            for j in range(size):
                flipped = task[j] * sign[j]
                agreeing[j] += 1.0 if flipped > 0 else 0.0
                positive = 0.0 if flipped <= 0 else flipped  # as clamp(min=0): NaN stays NaN
                kept[j] = positive if k == 0 else kept[j] + positive
        for j in range(size):
            merged = kept[j] * sign[j] + 0.0
            total[j] = merged / max(agreeing[j], 1.0) if combine == AGREEING_MEAN else merged


@numba.njit(inline="always", error_model="numpy")
def _masked(x, b, keep, scale, divisor):  # pragma: no cover - compiled
    task = (x - b) * (1.0 if keep else 0.0) * scale
    return task / divisor if divisor != 0.0 else task


@_jit
def _magnitudes(x, b):  # pragma: no cover - compiled
    values = np.empty(x.shape[0])
    for i in range(x.shape[0]):
        values[i] = abs(np.float64(x[i]) - np.float64(b[i]))
    return values


_SPLIT_TILE = 4096  # elements whose magnitudes are kept (in L1) between a tile's counting and its gathering


@_jit
def _split(x, b, bracket, upper, mask, values, indices, upper_values, upper_indices, offset):  # pragma: no cover
    lower_low, lower_high = bracket
    upper_low, upper_high = upper if upper is not None else (np.inf, np.inf)
    above = top = inside = inside_top = unordered = 0
    magnitudes = np.empty(_SPLIT_TILE)
    flags = np.zeros(_SPLIT_TILE, dtype=np.uint8)  # 1: in the bracket, 2: in the upper one
    for start in range(0, x.shape[0], _SPLIT_TILE):
        end = start + _SPLIT_TILE
        xs, bs, marks = x[start:end], b[start:end], mask[start:end]
        # Counting, marking and flagging first, branch-free so that it vectorizes (integer sums of
        # comparisons: boolean ``&`` keeps LLVM from it); the brackets are disjoint, so "above" is above
        # the lower one.
        tile_above = tile_top = tile_inside = tile_inside_top = 0
        for j in range(xs.shape[0]):
            value = abs(np.float64(xs[j]) - np.float64(bs[j]))
            magnitudes[j] = value
            over = value > lower_high
            in_lower = np.int64(value >= lower_low) - np.int64(over)
            tile_above += np.int64(over)
            tile_inside += in_lower
            unordered += np.int64(value != value)
            if upper is not None:  # numba compiles a ``None`` upper without this branch
                high = value > upper_high  # among the top ``skip``: out of the window
                in_upper = np.int64(value >= upper_low) - np.int64(high)
                tile_top += np.int64(high)
                tile_inside_top += in_upper
                marks[j] = over > high
                flags[j] = in_lower | (in_upper << 1)
            else:
                marks[j] = over
                flags[j] = in_lower
        flags[xs.shape[0] :] = 0  # the rest of a last, shorter tile
        if tile_inside or tile_inside_top:
            _gather(magnitudes, flags, values, indices, upper_values, upper_indices, inside, inside_top, offset + start)
        above, top = above + tile_above, top + tile_top
        inside, inside_top = inside + tile_inside, inside_top + tile_inside_top
    return above, inside, top, inside_top, unordered


@numba.njit(inline="always", error_model="numpy")
def _gather(
    magnitudes, flags, values, indices, upper_values, upper_indices, filled, upper_filled, offset
):  # pragma: no cover
    """Append the flagged ``magnitudes`` and their indices (from ``offset``) after the first ``filled`` (flag 1)
    or ``upper_filled`` (flag 2) slots of ``values`` and ``indices`` or of ``upper_values`` and
    ``upper_indices``, as many as fit.

    Eight flags are tested at a time, and most such words are zero (a bracket holds a few percent of the
    entries); a word that is not is gathered branch-free: each magnitude is written at the next free
    slot, which only a flagged one takes (a branch per element mispredicts and cost twice as much)."""
    room, upper_room = values.shape[0], upper_values.shape[0]
    words = flags.view(np.uint64)
    for word in range(words.shape[0]):
        if words[word] == 0:
            continue
        for j in range(8 * word, 8 * word + 8):
            if filled < room:  # past the room only the count goes on: the caller sees that it overflowed
                values[filled], indices[filled] = magnitudes[j], offset + j
            filled += np.int64(flags[j] & 1)
            if upper_filled < upper_room:
                upper_values[upper_filled], upper_indices[upper_filled] = magnitudes[j], offset + j
            upper_filled += np.int64(flags[j] >> 1)


@_jit
def _finish(mask, values, indices, wanted, mark):  # pragma: no cover - compiled
    cut = _kth_largest(values, wanted)
    at_cut = wanted
    for q in range(values.shape[0]):
        at_cut -= values[q] > cut
    for q in range(values.shape[0]):
        if values[q] > cut:
            mask[indices[q]] = mark
        elif values[q] == cut and at_cut > 0:
            mask[indices[q]] = mark
            at_cut -= 1


@_jit
def _sample_ranks(x, b, low_rank, high_rank):  # pragma: no cover - compiled
    sample = np.empty(x.shape[0])
    for i in range(sample.shape[0]):
        sample[i] = abs(np.float64(x[i]) - np.float64(b[i]))
    if np.isnan(sample).any():  # unordered: a NaN bracket, which every comparison misses
        return np.nan, np.nan
    return _kth_largest(sample, low_rank), _kth_largest(sample, high_rank) if high_rank > 1 else np.inf


_RADIX_BITS = 11  # a radix step's digit: 2,048 counts, in L1


@numba.njit(inline="always", error_model="numpy")
def _kth_largest(values, k):  # pragma: no cover - compiled
    """The ``k``-th largest of ``values`` (1 the largest; non-negative, no NaN), as ``np.partition`` would
    give it, found by radix steps on the bit patterns, which order as the values: each counts the next
    11 bits below the candidates' shared prefix and keeps the one digit's candidates that holds the k-th.
    With numba's own ``np.partition`` of a copy a cut took 24 ns a gathered entry, now 5 (marking included)."""
    keys = values.view(np.uint64)
    counts = np.empty(1 << _RADIX_BITS, np.int64)
    digits = np.uint64(1 << _RADIX_BITS)
    while True:
        low, high = keys[0], keys[0]
        for j in range(keys.shape[0]):
            low, high = min(low, keys[j]), max(high, keys[j])
        if low == high:
            return _value_of(low)
        if keys.shape[0] <= 64:
            return _value_of(np.sort(keys)[keys.shape[0] - k])
        shift = np.uint64(0)
        while ((high ^ low) >> shift) >= digits:  # the digit: the 11 bits below the keys' shared prefix
            shift += np.uint64(1)
        start = low >> shift
        counts[:] = 0
        for j in range(keys.shape[0]):
            counts[(keys[j] >> shift) - start] += 1
        digit = counts.shape[0] - 1
        while counts[digit] < k:  # from the top: the digit whose keys hold the k-th largest
            k -= counts[digit]
            digit -= 1
        chosen, filled, wanted = np.empty(counts[digit], np.uint64), 0, start + np.uint64(digit)
        for j in range(keys.shape[0]):
            if keys[j] >> shift == wanted:
                chosen[filled] = keys[j]
                filled += 1
        keys = chosen


@numba.njit(inline="always", error_model="numpy")
def _value_of(key):  # pragma: no cover - compiled
    """The float64 whose bit pattern is ``key``."""
    return np.array([key]).view(np.float64)[0]


def sample_ranks(x: np.ndarray, b: np.ndarray, low_rank: int, high_rank: int) -> tuple[float, float]:
    """Among |x − b| (float64; strided views of a sample, say), the values ranked ``low_rank`` and
    ``high_rank`` from the top (1 the largest); ``high_rank`` ≤ 1 gives +inf for the latter, a NaN
    anywhere NaN for both."""
    return _sample_ranks(x, b, low_rank, high_rank)


def magnitudes(x: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|x − b| in float64 (1-D, float32 or float64 alike)."""
    return _magnitudes(x, b)


def split(
    x: np.ndarray, b: np.ndarray, bracket: tuple[float, float], upper: tuple[float, float] | None, mask: np.ndarray,
    gathered: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], at: tuple[int, int], offset: int,
) -> tuple[int, int, int, int, int]:  # fmt: skip
    """One pass over |x − b| (computed in float64) for a window of ranks: entries above the ``upper``
    bracket (the top ones to skip) are marked False, those in it True and gathered; below it, entries
    above ``bracket`` are marked True, those in it False and gathered. Gathered: (value, ``offset`` +
    index) into ``gathered`` (the bracket's values and indices, then the upper bracket's) from the
    positions ``at``, as many as fit. ``upper`` None: no top to skip. Returns how many were
    above the bracket, in it, above the upper bracket, in it, and how many are NaN."""
    values, indices, upper_values, upper_indices = gathered
    at_lower, at_upper = at
    assert upper is None or upper[0] > bracket[1], "the upper bracket must lie above the lower one"
    return _split(
        x, b, bracket, upper, mask, values[at_lower:], indices[at_lower:], upper_values[at_upper:],
        upper_indices[at_upper:], offset,
    )  # fmt: skip


def finish(mask: np.ndarray, values: np.ndarray, indices: np.ndarray, wanted: int, mark: bool = True) -> None:
    """Set to ``mark`` in ``mask`` the ``wanted`` largest of the gathered ``values`` (at ``indices``), equal
    ones to the lower index (the gathered entries are in index order)."""
    _finish(mask, values, indices, wanted, mark)


@_jit
def _twist(state, tempered):  # pragma: no cover - compiled
    """MT19937's next 624 words in place, and their tempered outputs into ``tempered``."""
    _advance(state)
    _temper_all(state, tempered)


@_jit
def _advance(state):  # pragma: no cover - compiled
    """MT19937's next 624 words in place (Matsumoto & Nishimura's generator, as torch's CPU engine)."""
    upper, lower, matrix, one = np.uint32(0x80000000), np.uint32(0x7FFFFFFF), np.uint32(0x9908B0DF), np.uint32(1)
    for i in range(227):
        y = (state[i] & upper) | (state[i + 1] & lower)
        state[i] = state[i + 397] ^ (y >> one) ^ (matrix * (state[i + 1] & one))
    for i in range(227, 623):
        y = (state[i] & upper) | (state[i + 1] & lower)
        state[i] = state[i - 227] ^ (y >> one) ^ (matrix * (state[i + 1] & one))
    y = (state[623] & upper) | (state[0] & lower)
    state[623] = state[396] ^ (y >> one) ^ (matrix * (state[0] & one))


@_jit
def skip(state, position, words):  # pragma: no cover - compiled
    """Advance an MT19937 stream (``state``, ``position`` as in ``uniforms_below``) past ``words`` outputs
    without making them: a twist per 624, about a seventh of what making them costs."""
    left, following = position[0], position[1]
    if words <= left - 1:
        position[0], position[1] = left - words, following + words
        return
    words -= left - 1
    twists = (words + 623) // 624
    for _ in range(twists):
        _advance(state)
    last = words - 624 * (twists - 1)  # words taken after the last twist, 1..624
    position[0], position[1] = 625 - last, last


@_jit
def _temper_all(state, tempered):  # pragma: no cover - compiled
    for i in range(624):
        y = state[i]
        y ^= y >> np.uint32(11)
        y ^= (y << np.uint32(7)) & np.uint32(0x9D2C5680)
        y ^= (y << np.uint32(15)) & np.uint32(0xEFC60000)
        tempered[i] = y ^ (y >> np.uint32(18))


_DRAW_TILE = 1024  # uniforms made at a time before they are compared: they stay in L1


@_jit
def uniforms_below(state, position, keep, keep_each, out):  # pragma: no cover - compiled
    """``out[i] = u_i < keep`` (or ``< keep_each[i]`` when that has entries) for consecutive float64
    uniforms u_i of an MT19937 stream: ``state`` its 624 words, ``position`` (left, next) as torch's CPU
    engine keeps them, both advanced in place (``draw``)."""
    tempered = np.empty(624, dtype=np.uint32)
    _temper_all(state, tempered)
    tile = np.empty(_DRAW_TILE)
    each = keep_each.shape[0] > 0
    for first in range(0, out.shape[0], _DRAW_TILE):
        size = min(out.shape[0], first + _DRAW_TILE) - first
        draw(state, tempered, position, tile[:size])
        kept = out[first : first + size]  # a slice indexed from 0: the loop vectorizes (``draw``)
        if each:
            keeps = keep_each[first : first + size]
            for i in range(size):
                kept[i] = tile[i] < keeps[i]
        else:
            for i in range(size):
                kept[i] = tile[i] < keep


@numba.njit(inline="always", error_model="numpy")
def draw(state, tempered, position, out):  # pragma: no cover - compiled
    """The next ``len(out)`` float64 uniforms of an MT19937 stream into ``out``: ``state`` its 624 words and
    ``tempered`` their tempered outputs, ``position`` (left, next) as torch's CPU engine keeps them, all
    advanced in place. Each uniform is torch's: the 53 low bits of two words (the first the high half)
    times 2⁻⁵³."""
    left, following = position[0], position[1]
    scale = 1.0 / 9007199254740992.0
    done, total = 0, out.shape[0]
    while done < total:
        pairs = min((left - 1) // 2, total - done)  # uniforms whose two words come before the next twist
        # slices indexed from 0: the loop then vectorizes (with ``out[done + q]``, a third slower)
        words, drawn = tempered[following : following + 2 * pairs], out[done : done + pairs]
        for q in range(pairs):
            word = (np.uint64(words[2 * q]) << np.uint64(32)) | np.uint64(words[2 * q + 1])
            drawn[q] = np.float64(np.int64(word & np.uint64(0x1FFFFFFFFFFFFF))) * scale  # exact: below 2⁵³
        done, left, following = done + pairs, left - 2 * pairs, following + 2 * pairs
        if done < total:  # one uniform across a twist, word by word
            left -= 1
            if left == 0:
                _twist(state, tempered)
                left, following = 624, 0
            high = np.uint64(tempered[following])
            following += 1
            left -= 1
            if left == 0:
                _twist(state, tempered)
                left, following = 624, 0
            word = (high << np.uint64(32)) | np.uint64(tempered[following])
            following += 1
            out[done] = np.float64(np.int64(word & np.uint64(0x1FFFFFFFFFFFFF))) * scale
            done += 1
    position[0], position[1] = left, following


# DELLA. The eager code (``mergeflow.merge.della``) sorts every row of every task vector with a stable
# ``argsort`` to rank its magnitudes, which dominated DELLA's time. Here a row's magnitudes get 16-bit keys
# (0 for exact zeros, then 65,535 equal steps up to the largest) and are radix-sorted by them, a byte at
# a time, least significant first. Each pass is stable, so equal keys stay in index order, and the few
# entries that share a key are then put in order by an insertion sort (equal magnitudes never pass each
# other). A row whose insertion sort runs long (a skewed row) or that holds a NaN or an infinity is
# ordered by a stable merge sort instead. Each entry's rank is then its position in that order, and its
# probability ``p = low + rank · step``, its uniform and its pruned value follow. ``della_merge`` prunes a
# block of rows of all K clients, each from its own position in the stream, and combines them while they
# are in cache; ``della_keep`` keeps only the keep flags and the rows' L1 norms (for mergekit's ``l1``
# rescale, which needs each whole vector's norm before anything is merged).

RESCALE_NONE, RESCALE_PROBABILITY = 0, 1  # DELLA's rescale: none (mergekit's l1 is applied afterwards) or by 1/p

_DELLA_MOVES = 32  # moves an entry the insertion sort may make on average before its row is merge-sorted instead
_DELLA_BLOCK = 4096  # elements of each client pruned before the block is merged: K such rows stay in L2


@_jit
def della_merge(
    xs, base, width, step, low, rescale, states, positions, first, last, coefficient, combine, out
):  # pragma: no cover
    """``out = base + coefficient · combine_k(pruned_k)`` for rows ``first:last`` of the tensor (``rows =
    n // width`` rows of ``width``), ``combine`` and ``out``'s dtype as ``cpu_kernels.masked_merge``'s.

    ``xs`` (a tuple, ``padded``) are the K clients' flat tensors and ``base`` the base's (float32 or float64,
    widened here). Client k's draws come from ``states[k]`` and ``positions[k]`` (``cpu_kernels.draw``), set to
    its row ``first``'s first uniform and advanced in place; pruning as ``_prune_row``."""
    count = states.shape[0]
    per_block = max(1, _DELLA_BLOCK // width)
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
        merged, b = out[at : at + size], base[at : at + size]  # slices: as ``masked_merge``
        for j in range(size):
            merged[j] = np.float64(b[j]) + coefficient * total[j]


@_jit
def della_keep(xs, base, width, step, low, state, position, first, last, bits, norms):  # pragma: no cover - compiled
    """DELLA's keep flags of stream rows ``first:last`` into ``bits`` (``(K · rows, ⌈width / 8⌉)`` uint8: row g's
    flags packed from the first byte of its own row, high bit first, as ``np.unpackbits`` reads them) and each
    row's L1 norm before and after the drops into ``norms`` (``(K · rows, 2)`` float64): mergekit's ``l1``
    rescale without writing the pruned task vectors out.

    The stream is the K clients' rows one client after another (row g is client ``g // rows``'s row
    ``g % rows``), as the eager code draws them. Each entry of task ``t = x − base`` gets
    ``p = low + rank · step`` (its rank by magnitude in its row, equal ones by index) and its uniform
    ``u``, and is kept where ``u < p``. ``state`` and ``position`` are the generator at row ``first``'s first
    uniform."""
    rows = base.shape[0] // width
    scratch = _scratch(width)
    tempered = np.empty(624, dtype=np.uint32)
    pruned, flags, lanes = np.empty(width), np.empty(width, np.bool_), np.empty(8)
    _temper_all(state, tempered)
    for g in range(first, last):
        at = (g % rows) * width
        _prune_row(xs[g // rows][at : at + width], base[at : at + width], step, low, RESCALE_NONE, state, tempered,
                   position, scratch, pruned)  # fmt: skip
        uniform, ranks, sizes = scratch[5], scratch[0][1], scratch[3]
        for j in range(width):  # the flags as _prune_row drew them, from the uniforms and ranks it left
            flags[j] = uniform[j] < (low if step == 0.0 else ranks[j] * step + low)
            pruned[j] = abs(pruned[j])
        _pack(flags, bits[g])
        norms[g, 0], norms[g, 1] = _lane_sum(sizes, lanes), _lane_sum(pruned, lanes)


@numba.njit(inline="always", error_model="numpy")
def _pack(flags, packed):  # pragma: no cover - compiled
    """``flags`` (booleans) into the bytes ``packed``, high bit first, each byte built in a register."""
    width = flags.shape[0]
    for q in range(packed.shape[0]):
        byte = 0
        for t in range(min(8, width - 8 * q)):
            byte |= (1 if flags[8 * q + t] else 0) << (7 - t)
        packed[q] = byte


@numba.njit(inline="always", error_model="numpy")
def _lane_sum(values, lanes):  # pragma: no cover - compiled
    """The sum of ``values`` in a fixed order that vectorizes: eight running sums (entry j into sum j mod 8, the
    tail into the first ones), then those in order; ``lanes`` is their (8,) scratch."""
    lanes[:] = 0.0
    whole = values.shape[0] // 8 * 8
    for q in range(0, whole, 8):
        for t in range(8):
            lanes[t] += values[q + t]
    for j in range(whole, values.shape[0]):
        lanes[j - whole] += values[j]
    total = lanes[0]
    for t in range(1, 8):
        total += lanes[t]
    return total


@numba.njit(inline="always", error_model="numpy")
def _scratch(width):  # pragma: no cover - compiled
    """``_prune_row``'s working arrays for rows of ``width``: ``_radix_order``'s (its counts, keys and the
    first pass's keys and order), then order, ordered sizes, sizes, task and uniforms. The counts, keys and
    orders are int32, half the cache of int64; so rows are at most 2³¹ − 1 wide (``della._COMPILED_WIDEST``)."""
    keys, passed_keys, passed_order, order = np.empty((4, width), np.int32)
    radix = np.empty((2, 256), np.int32), keys, passed_keys, passed_order
    return radix, order, np.empty(width), np.empty(width), np.empty(width), np.empty(width)


@numba.njit(inline="always", error_model="numpy")
def _prune_row(x, b, step, low, rescale, state, tempered, position, scratch, out):  # pragma: no cover - compiled
    """One row's pruned task vector ``t · [u < p]`` into ``out`` (divided by ``p`` with ``RESCALE_PROBABILITY``),
    its uniforms drawn in index order (``della_keep``)."""
    radix, order, ordered, sizes, task, uniform = scratch
    width = x.shape[0]
    for j in range(width):
        difference = np.float64(x[j]) - np.float64(b[j])
        task[j], sizes[j] = difference, abs(difference)
    draw(state, tempered, position, uniform)
    if step == 0.0:  # one probability for all
        for j in range(width):
            kept = task[j] * (1.0 if uniform[j] < low else 0.0)
            out[j] = kept / low if rescale == RESCALE_PROBABILITY else kept
        return
    largest = _largest(sizes)
    if not largest < np.inf or not _radix_order(sizes, largest, radix, order, ordered):  # NaN or ±inf: sorted
        _sort_order(sizes, order)
    ranks = radix[1]  # the keys are spent: their room takes each entry's rank
    for rank in range(width):
        ranks[order[rank]] = rank
    for j in range(width):  # in index order and branch-free, so that it vectorizes
        p = ranks[j] * step + low
        kept = task[j] * (1.0 if uniform[j] < p else 0.0)
        out[j] = kept / p if rescale == RESCALE_PROBABILITY else kept


@numba.njit(inline="always", error_model="numpy")
def _radix_order(sizes, largest, radix, order, ordered):  # pragma: no cover - compiled
    """The stable ascending order of a row's finite ``sizes`` (``largest`` the largest of them) into ``order``
    (and the sizes so ordered into ``ordered``): radix-sorted by 16-bit keys (0 for exact zeros, then
    65,535 equal steps up to the largest), a byte a pass, then insertion-sorted. ``radix``: ``(2, 256)``
    counts, the keys, and the first pass's keys and order (``_scratch``). False, with ``order`` undone,
    when the insertion sort would move entries more than ``_DELLA_MOVES`` times each on average (a skewed
    row)."""
    counts, keys, passed_keys, passed_order = radix
    width = sizes.shape[0]
    scale = 65534.5 / largest if largest > 0 else 0.0  # below 65,535 even at the largest
    if not scale < np.inf:  # a subnormal largest
        return False
    for j in range(width):  # apart from the counting, so that it vectorizes
        size = sizes[j]
        keys[j] = np.int32(0) if size == 0.0 else np.int32(1 + np.int64(size * scale))
    low, high = counts[0], counts[1]
    counts[:] = 0
    for j in range(width):
        key = keys[j]
        low[key & 255] += 1
        high[key >> 8] += 1
    low_start, high_start = 0, 0
    for digit in range(256):  # each count becomes its digit's first position
        low_count, high_count = low[digit], high[digit]
        low[digit], high[digit] = low_start, high_start
        low_start, high_start = low_start + low_count, high_start + high_count
    for j in range(width):  # by the low byte; in index order, so that equal keys stay in it
        key = keys[j]
        where = low[key & 255]
        low[key & 255] = where + 1
        passed_order[where], passed_keys[where] = j, key
    for q in range(width):  # by the high byte, stably
        where = high[passed_keys[q] >> 8]
        high[passed_keys[q] >> 8] = where + 1
        order[where] = passed_order[q]
    for q in range(width):
        ordered[q] = sizes[order[q]]
    moves = _DELLA_MOVES * width
    for q in range(1, width):  # equal sizes never move past each other: index order stays among them
        size = ordered[q]
        if ordered[q - 1] <= size:
            continue
        j, before = order[q], q - 1
        while before >= 0 and ordered[before] > size:
            ordered[before + 1], order[before + 1] = ordered[before], order[before]
            before -= 1
        moves -= q - 1 - before
        if moves < 0:
            return False
        ordered[before + 1], order[before + 1] = size, j
    return True


@numba.njit(inline="always", error_model="numpy")
def _largest(sizes):  # pragma: no cover - compiled
    """The largest of the magnitudes ``sizes`` (NaN above +inf): the largest of their bit patterns, which
    order as their values (a sign bit clear) and whose integer maximum vectorizes, as a float's does not."""
    bits, top = sizes.view(np.uint64), np.uint64(0)
    for j in range(sizes.shape[0]):
        top = max(top, bits[j])
    return _value_of(top)


@numba.njit(inline="always", error_model="numpy")
def _sort_order(sizes, order):  # pragma: no cover - compiled
    """The stable ascending order of ``sizes`` into ``order``, NaNs last (as torch's ``argsort``): the bit
    patterns of non-negative doubles order as their values, every NaN made the same."""
    bits = sizes.view(np.uint64).copy()
    for j in range(bits.shape[0]):
        if sizes[j] != sizes[j]:
            bits[j] = np.uint64(0x7FF8000000000000)
    order[:] = np.argsort(bits, kind="mergesort")
