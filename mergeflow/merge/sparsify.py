"""Task-vector sparsification, sign election and the masked merge, shared by the sparsifying merges.

The masks of TIES (top magnitudes: ``magnitude_masks``), DARE (random drops: ``dropout_masks``) and
Breadcrumbs (outliers and smallest dropped: ``outlier_masks``), their selection kernels, and the merge of
the masked task vectors (``masked_merge``); DELLA's per-tensor draws (``tensor_generator``,
``bernoulli_draws``), disjoint mean and threads. The methods themselves are in their own modules.

Semantics follow the papers and PEFT's ``merge_utils`` (checked against it in the tests): trimming
keeps ``int(density * numel)`` entries per tensor, the elected sign is that of the summed task
vectors (ties go to +), and the disjoint mean averages only the non-zero entries that agree with it.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import TypeVar

import numpy as np
import torch

from mergeflow.merge.engine import TaskOperands, TaskVectors, TensorInputs
from mergeflow.merge.sums import running_sum

# From this many entries on, the cut is found by radix selection in blocks, not ``kthvalue``.
_RADIX_FROM = 1 << 22
_RADIX_BLOCK = 1 << 20
_GATHER_BELOW = 1 << 18  # entries sharing the bits found so far, gathered for ``kthvalue`` (2 MiB)
# From this many entries on, the cut is first bracketed between two values of an evenly spaced sample.
_SAMPLE_FROM = 1 << 16
_SAMPLE_SIZE = 1 << 14
T, R = TypeVar("T"), TypeVar("R")


def magnitude_masks(tasks: Iterable[torch.Tensor], density: float) -> Iterator[torch.Tensor]:
    """TIES' trim: for each task vector in turn, a mask of its ``int(density * numel)`` largest magnitudes.

    Equal magnitudes at the cut go to the lower index (``topk``, which PEFT and mergekit use, leaves
    that order unspecified). Each task vector is overwritten with its magnitudes; a boolean mask and,
    for a large tensor, block-sized selection temporaries are all that is added. Task vectors in memory
    together on a GPU (``TaskVectors.together``) are selected in all K rows at once (``top_masks``).
    """
    if _compiled(tasks):
        count, out = tasks.operands.count, tasks.out.numpy() if tasks.out is not None else None
        yield from torch.from_numpy(top_of_differences(tasks.operands, min(int(density * count), count), out)).unbind(0)
        return
    for magnitudes, shape in _magnitudes(tasks):
        count = magnitudes.shape[-1]
        yield from _rows(_top(magnitudes, min(int(density * count), count)), shape)


def outlier_masks(tasks: Iterable[torch.Tensor], density: float, gamma: float) -> Iterator[torch.Tensor]:
    """Model Breadcrumbs' masks: for each task vector in turn, drop its ``int(gamma * numel)`` largest
    magnitudes and keep the next ``int(density * numel)`` (mergekit's ``magnitude_outliers``).

    Magnitudes ordered as in ``magnitude_masks`` (equal ones by index), so the kept entries are ranks
    ``[n_top, n_top + n_keep)`` of one order. The task vectors are overwritten with their magnitudes.
    """

    def ranks(count: int) -> tuple[int, int]:
        top = min(int(gamma * count), count)
        return top, min(int(density * count), count - top)

    if _compiled(tasks):
        top, kept = ranks(tasks.operands.count)
        out = tasks.out.numpy() if tasks.out is not None else None
        yield from torch.from_numpy(top_of_differences(tasks.operands, kept, out, skip=top)).unbind(0)
        return
    for magnitudes, shape in _magnitudes(tasks):
        top, kept = ranks(magnitudes.shape[-1])
        mask = _top(magnitudes, top + kept)
        if top:
            mask &= ~_top(magnitudes, top)
        yield from _rows(mask, shape)


def kernels() -> ModuleType:
    """``mergeflow.merge.cpu_kernels``, imported on first use: numba's import and first call (about 0.45 s)
    stay off every path that merges nothing sparsely on the CPU."""
    from mergeflow.merge import cpu_kernels

    return cpu_kernels


def _compiled(tasks: Iterable[torch.Tensor]) -> bool:
    """Whether the masks are selected by the compiled CPU kernels, from each client's tensor and the base."""
    return isinstance(tasks, TaskVectors) and tasks.operands is not None and tasks.device.type == "cpu"


def top_of_differences(operands: TaskOperands, keep: int, out: np.ndarray | None = None, skip: int = 0) -> np.ndarray:
    """:func:`top_mask` of each |θ_k − base| (flat), computed in float64 by compiled kernels on the CPU from
    the operands as stored, a chunk at a time; with ``skip``, the entries ranked ``skip`` to
    ``skip + keep − 1`` from the top (Breadcrumbs' window: ``top(skip + keep) & ~top(skip)``).

    Each cut is bracketed from an evenly spaced sample as in :func:`_bracketed_cut`; one pass over the
    chunks marks the entries between the brackets and gathers those inside them, and the cuts are
    finished among the gathered ones. The same masks, bit for bit; with NaNs, the eager code's. Written
    into ``out`` (``(K, count)`` booleans), else a new array."""
    clients, count = operands.clients, operands.count
    masks = out if out is not None else np.empty((clients, count), bool)
    if keep <= 0 or (keep >= count and not skip):
        masks[:] = keep > 0
        return masks
    if skip + keep >= count:  # a window that reaches the bottom: all but the top
        masks[:] = True
        masks &= ~top_of_differences(operands, skip)
        return masks
    if skip:
        window = lambda k: (*_bracket(operands, k, skip + keep), *_bracket(operands, k, skip))  # noqa: E731
        if not _select(operands, skip, keep, window, masks, range(clients)):
            return masks
        masks = top_of_differences(operands, skip + keep, masks)  # brackets that overlap or missed: two cuts
        masks &= ~top_of_differences(operands, skip)
        return masks
    none = (math.nan, math.nan, 0)
    missed = _select(operands, 0, keep, lambda k: (*_bracket(operands, k, keep), *none), masks, range(clients))
    missed = _select(operands, 0, keep, lambda k: (0.0, math.inf, count, *none), masks, missed)  # everything
    for k in missed:  # NaNs, which the compiled comparisons cannot order: the eager code's order
        magnitudes = np.concatenate([kernels().magnitudes(xs[0], b) for _, xs, b in operands.chunks([k])])
        masks[k] = top_mask(torch.from_numpy(magnitudes), keep).numpy()
    return masks


# A client's brackets: the low and high values and the room of the window's bottom cut, then of its top's.
_Brackets = Callable[[int], tuple[float, float, int, float, float, int]]


def _bracket(operands: TaskOperands, k: int, keep: int) -> tuple[float, float, int]:
    """Client k's bracket of its ``keep``-th largest |θ_k − base|, from an evenly spaced sample: its low
    and high values and room for twice the entries expected inside."""
    count = operands.count
    step = max(1, count // _SAMPLE_SIZE)
    high_rank, low_rank = _bracket_ranks(len(range(0, count, step)), count, keep)
    low, high = kernels().sample_ranks(*operands.every(k, step), low_rank, high_rank)
    return low, high, min(count, 2 * (low_rank - high_rank + 1) * step + (1 << 12))


def _select(
    operands: TaskOperands, skip: int, keep: int, brackets: _Brackets, masks: np.ndarray, clients: Sequence[int]
) -> list[int]:
    """Mark in ``masks[k]`` the entries ranked ``skip`` to ``skip + keep − 1`` of |θ_k − base| by gathering
    those in each client's ``brackets`` of the window's bottom and (``skip`` > 0) top; the clients for
    which that cannot find them (brackets overlap, a bracket misses its cut or overflows, or NaNs). The
    clients are split between torch's intra-op threads, each finding its brackets and making its pass."""
    threads = min(torch.get_num_threads(), len(clients))
    groups = [list(clients)[g::threads] for g in range(threads)]
    found = in_threads(lambda group: _select_group(operands, skip, keep, brackets, masks, group), groups)
    return sorted(k for missed in found for k in missed)


def in_threads(work: Callable[[T], R], parts: Sequence[T]) -> list[R]:
    """``work`` of each part, the parts on threads of their own (the compiled kernels release the GIL);
    a single part on this thread."""
    if len(parts) < 2:
        return [work(part) for part in parts]
    return list(_pool(len(parts)).map(work, parts))


def thread_shares(count: int, least: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges that split ``count`` elements evenly between torch's intra-op threads, each at
    least ``least`` long: a single range when ``count`` is short."""
    parts = max(1, min(torch.get_num_threads(), count // least))
    bounds = [count * p // parts for p in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


@functools.cache
def _pool(size: int) -> ThreadPoolExecutor:
    """A pool of ``size`` threads, kept: starting one per tensor cost 0.3 ms, a sixth of a small tensor's masks.
    Work run on it must not call :func:`in_threads` itself (it could wait on its own pool's threads)."""
    return ThreadPoolExecutor(size, thread_name_prefix="mergeflow-kernels")


os.register_at_fork(after_in_child=_pool.cache_clear)  # a forked child has none of the parent's threads


def _select_group(
    operands: TaskOperands, skip: int, keep: int, brackets: _Brackets, masks: np.ndarray, group: list[int]
) -> list[int]:
    cpu_kernels = kernels()
    found = {k: brackets(k) for k in group}
    # the top's low not above the bottom's high (NaN brackets, from a NaN in the sample, are not above either)
    overlapping = [k for k in group if skip and not found[k][3] > found[k][1]]
    group = [k for k in group if k not in overlapping]
    gathered = {}
    for k in group:
        room, upper_room = found[k][2], found[k][5]
        gathered[k] = (np.empty(room), np.empty(room, np.int64), np.empty(upper_room), np.empty(upper_room, np.int64))
    counts = {k: np.zeros(5, dtype=np.int64) for k in group}  # above, inside, top, inside the top's, NaNs
    for start, xs, b in operands.chunks(group) if group else ():
        for k, x in zip(group, xs, strict=True):
            low, high, room, upper_low, upper_high, upper_room = found[k]
            at = (min(counts[k][1], room), min(counts[k][3], upper_room))
            part = masks[k, start : start + b.shape[0]]
            upper = (upper_low, upper_high) if skip else None
            counts[k] += cpu_kernels.split(x, b, (low, high), upper, part, gathered[k], at, start)
    missed = overlapping
    for k in group:
        above, inside, top, inside_top, unordered = (int(c) for c in counts[k])
        room, upper_room = found[k][2], found[k][5]
        hit = above < skip + keep <= above + inside and (not skip or top < skip <= top + inside_top)
        if unordered or inside > room or inside_top > upper_room or not hit:
            missed.append(k)
            continue
        values, indices, upper_values, upper_indices = gathered[k]
        cpu_kernels.finish(masks[k], values[:inside], indices[:inside], skip + keep - above)
        if skip:  # the upper bracket's largest are among the top skip, out of the window
            cpu_kernels.finish(masks[k], upper_values[:inside_top], upper_indices[:inside_top], skip - top, False)
    return missed


def _magnitudes(tasks: Iterable[torch.Tensor]) -> Iterator[tuple[torch.Tensor, tuple[int, ...]]]:
    """The task vectors' magnitudes, flat, with each vector's shape: all K as one ``(K, n)`` tensor when
    they are in memory together on an accelerator, else one vector at a time (overwritten with its
    magnitudes). The CPU selects row by row: there ``kthvalue`` is fast and the batch's sorts 3x slower."""
    if isinstance(tasks, TaskVectors) and tasks.together is not None and tasks.device.type != "cpu":
        together = tasks.together()
        yield together.reshape(len(together), -1).abs_(), tuple(together.shape[1:])
        return
    for task in tasks:
        yield task.reshape(-1).abs_(), tuple(task.shape)


def _top(magnitudes: torch.Tensor, keep: int) -> torch.Tensor:
    return top_masks(magnitudes, keep) if magnitudes.dim() == 2 else top_mask(magnitudes, keep)


def _rows(mask: torch.Tensor, shape: tuple[int, ...]) -> Iterator[torch.Tensor]:
    """Each task vector's mask in its own shape: the rows of a ``(K, n)`` mask, or a single flat one."""
    yield from (row.view(shape) for row in (mask.unbind(0) if mask.dim() == 2 else [mask]))


def top_masks(magnitudes: torch.Tensor, keep: int) -> torch.Tensor:
    """:func:`top_mask` of every row of a ``(K, n)`` tensor at once: the same masks, from a few kernels
    and host syncs for all K rows rather than K times as many (launches, not arithmetic, bound a GPU
    on a model's many small tensors). Rows whose cut the bracket misses are selected alone."""
    rows, count = magnitudes.shape
    if keep <= 0 or keep >= count:
        return torch.full(magnitudes.shape, keep > 0, dtype=torch.bool, device=magnitudes.device)
    if count >= _SAMPLE_FROM:
        cuts, found = _bracketed_cuts(magnitudes, keep)
        for row in (r for r in range(rows) if not found[r]):
            cuts[row] = kth_largest(magnitudes[row], keep)
    else:
        cuts = kth_smallest(magnitudes, count - keep + 1)
    kept = magnitudes >= cuts[:, None]
    for row, surplus in enumerate((kept.sum(1) - keep).tolist()):
        if surplus > 0:  # the cut's value repeats across it: the equal entries at the highest indices go
            kept[row, (magnitudes[row] == cuts[row]).nonzero().view(-1)[-surplus:]] = False
    return kept


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
    """The ``k``-th smallest along the last dimension: ``kthvalue`` on the CPU, a sort on an accelerator,
    where ``kthvalue`` selects a whole slice in one block of threads (8.3 ms against a sort's 0.3 ms for
    1.5M doubles on an H200, docs/benchmarks.md). The same values either way."""
    if values.device.type == "cpu":
        return values.kthvalue(k, dim=-1).values
    return values.sort(dim=-1).values[..., k - 1]


def _bracketed_cuts(values: torch.Tensor, k: int) -> tuple[torch.Tensor, list[bool]]:
    """:func:`_bracketed_cut` in every row of a ``(K, n)`` tensor at once: each row's ``k``-th largest,
    and whether its bracket held it (a row whose bracket missed has a meaningless cut)."""
    rows, count = values.shape
    sample = values[:, :: max(1, count // _SAMPLE_SIZE)]
    high_rank, low_rank = _bracket_ranks(sample.shape[1], count, k)
    ordered = sample.sort(dim=1, descending=True).values
    high, low = ordered[:, high_rank - 1, None], ordered[:, low_rank - 1, None]
    between = values >= low
    reaching = between.sum(1)  # entries at or above each row's bracket
    if high_rank > 1:
        between.logical_and_(values <= high)
    sizes = between.sum(1)
    inside = values[between]  # row by row, each row's entries in index order
    above = reaching - sizes
    row_of = torch.repeat_interleave(torch.arange(rows, device=values.device), sizes, output_size=inside.numel())
    by_value = inside.argsort(stable=True)
    ascending = inside[by_value[row_of[by_value].argsort(stable=True)]]  # each row's entries ascending
    position = (sizes.cumsum(0) + above - k).clamp_(0, max(inside.numel() - 1, 0))  # start + size - (k - above)
    found = ((above < k) & (k <= reaching)).tolist()
    return (ascending[position] if inside.numel() else low.view(-1).clone()), found


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
    high_rank, low_rank = _bracket_ranks(sample.numel(), count, k)
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


def _bracket_ranks(size: int, count: int, k: int) -> tuple[int, int]:
    """The ranks from the top, within an evenly spaced sample of ``size`` of ``count`` values, of the two
    sample values that bracket the ``k``-th largest: a few standard deviations either side of k's rank."""
    expected = k * size / count  # k's rank from the top within the sample
    margin = 4.0 * math.sqrt(expected * (1.0 - k / count)) + 4.0
    return max(1, int(expected - margin)), min(size, int(expected + margin) + 1)


def dropout_masks(
    count: int, shape: tuple[int, ...], drop_rate: float, generator: torch.Generator, out: torch.Tensor | None = None
) -> Iterator[torch.Tensor]:
    """DARE's drops: ``count`` masks that keep each entry with probability 1 − ``drop_rate``, drawn one task
    vector after another from ``generator`` (as PEFT's ``random_pruning`` with the same seed), on the
    generator's device (``bernoulli_draws``); into the rows of ``out`` (``(count, n)`` booleans) if given."""
    if out is not None and drop_rate and generator.device.type == "cpu":
        # all K at once: on the CPU's serial stream the same draws, one task vector after another (a GPU's
        # Philox offsets each call, so there one draw of K vectors differs from K draws of one)
        yield from bernoulli_draws((count, *shape), 1.0 - drop_rate, generator, out.view(count, *shape)).unbind(0)
        return
    for k in range(count):
        mask = out[k].view(shape) if out is not None else torch.empty(shape, dtype=torch.bool, device=generator.device)
        if drop_rate == 0:
            yield mask.fill_(True)
        else:
            yield bernoulli_draws(shape, 1.0 - drop_rate, generator, out=mask)


def bernoulli_draws(
    shape: tuple[int, ...], keep: float | torch.Tensor, generator: torch.Generator, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Booleans, each True with probability ``keep`` (a number, or a float64 tensor of ``shape``), on the
    generator's device.

    A float64 uniform below ``keep``: on the CPU the same draws, bit for bit, and the same generator state
    after, as ``torch.bernoulli`` of a float64 tensor of probabilities (both compare one 53-bit uniform
    per entry with p), in half its time and without the tensor of probabilities. The CPU draws them
    from the generator's own MT19937 state with a compiled loop (``cpu_kernels.uniforms_below``), twice
    as fast as ``torch.rand``: the same uniforms, and the generator is advanced past them. ``out``: a
    contiguous boolean tensor of ``shape`` to write them into.
    """
    if generator.device.type == "cpu" and compiled_draws_match():
        return _compiled_draws(shape, keep, generator, out)
    drawn = torch.rand(shape, dtype=torch.float64, device=generator.device, generator=generator) < keep
    return out.copy_(drawn) if out is not None else drawn


# torch's CPU generator state: its MT19937 ``left`` (int32 at byte 8), ``next`` (uint64 at 16) and 624
# words (each a uint64 from byte 24), in a 5,056-byte CPUGeneratorImplState.
_STATE_BYTES, _LEFT, _NEXT, _WORDS = 5056, 8, 16, 24
_DRAWS_PER_THREAD = 1 << 20  # uniforms a thread draws, at least, when a run of draws is split


def _compiled_draws(
    shape: tuple[int, ...], keep: float | torch.Tensor, generator: torch.Generator, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The draws of ``bernoulli_draws`` on the CPU, from the generator's own MT19937 state, which is then
    advanced past them. A long run of draws is split between torch's intra-op threads: each skips to
    its first uniform (``cpu_kernels.skip``, a seventh of the cost of making them) and draws its share."""
    cpu_kernels = kernels()
    words, position = stream_state(generator)
    out = out if out is not None else torch.empty(shape, dtype=torch.bool, device=generator.device)
    flat, each = out.view(-1).numpy(), keep.reshape(-1).numpy() if isinstance(keep, torch.Tensor) else np.empty(0)
    shares = thread_shares(len(flat), _DRAWS_PER_THREAD)
    streams = [(words.copy(), position.copy()) for _ in shares]

    def draw(part: tuple[tuple[int, int], tuple[np.ndarray, np.ndarray]]) -> None:
        (a, z), stream = part
        cpu_kernels.skip(*stream, 2 * a)  # two words a uniform
        cpu_kernels.uniforms_below(*stream, float(keep) if not len(each) else 0.0, each[a:z], flat[a:z])

    in_threads(draw, list(zip(shares, streams, strict=True)))
    words, position = streams[-1]
    raw = generator.get_state()
    state = raw.numpy()
    state[_WORDS : _WORDS + 624 * 8].view(np.uint64)[:] = words
    state[_LEFT : _LEFT + 4].view(np.int32)[0] = position[0]
    state[_NEXT : _NEXT + 8].view(np.uint64)[0] = position[1]
    generator.set_state(raw)
    return out


def stream_state(generator: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A CPU generator's MT19937 stream as the compiled kernels take it (``cpu_kernels.draw``): its 624
    words (uint32) and its position (left, next), copies."""
    state = generator.get_state().numpy()
    words = state[_WORDS : _WORDS + 624 * 8].view(np.uint64).astype(np.uint32)
    left, following = state[_LEFT : _LEFT + 4].view(np.int32)[0], state[_NEXT : _NEXT + 8].view(np.uint64)[0]
    return words, np.array([left, following], dtype=np.int64)


@functools.cache
def compiled_draws_match() -> bool:
    """Whether the compiled draws equal ``torch.rand``'s here (this torch's generator layout and stream)."""
    cpu = torch.device("cpu")
    if torch.Generator(device=cpu).get_state().numel() != _STATE_BYTES:
        return False
    ours, theirs = torch.Generator(device=cpu).manual_seed(1), torch.Generator(device=cpu).manual_seed(1)
    probabilities = torch.rand(1000, dtype=torch.float64, device=cpu, generator=torch.Generator(device=cpu))
    for keep in (0.5, probabilities):
        expected = torch.rand(1000, dtype=torch.float64, device=cpu, generator=theirs) < keep
        if not torch.equal(_compiled_draws((1000,), keep, ours), expected):
            return False
    return torch.equal(ours.get_state(), theirs.get_state())


_MERGE_PER_THREAD = 1 << 18  # elements a thread merges, at least, when a block is split between threads


def masked_merge(x: TensorInputs, coefficient: float, combine: str, divisor: float | None = None) -> torch.Tensor:
    """``base + coefficient · combine_k((θ_k − base) · mask_k / divisor)``: the merge step of TIES, DARE and
    Breadcrumbs, elementwise over ``x``'s tensors (or block) with their ``masks``, in float64.

    ``combine``: ``"sum"`` (in order k = 0..K−1), ``"agreeing_sum"`` (``agreeing_sum``'s total) or
    ``"agreeing_mean"`` (TIES' disjoint mean). The tensors and the base may be float32 or float64 (a
    streamed merge passes them as stored); each is widened to float64 first. On the CPU one compiled loop
    (``cpu_kernels.masked_merge``, a long block split between torch's intra-op threads, into ``x.out`` if
    given, rounded once to its dtype) does what the eager code (``masked_merge_eager``, every other
    device) does in about fifteen passes, with the same bits.
    """
    assert x.base is not None and x.masks is not None  # methods with masks need base (schema), masks=
    if x.base.device.type != "cpu":
        return masked_merge_eager(x, coefficient, combine, divisor)
    cpu_kernels = kernels()
    xs, base, out = kernel_operands(x)
    masks = x.masks.reshape(len(xs), -1).numpy()
    flat, code = out.view(-1).numpy(), getattr(cpu_kernels, combine.upper())  # SUM, AGREEING_SUM or AGREEING_MEAN

    slots, scales = cpu_kernels.padded(xs), np.ones(len(xs))

    def merge(share: tuple[int, int]) -> None:
        cpu_kernels.masked_merge(slots, base, masks, scales, divisor or 0.0, coefficient, code, flat, *share)

    in_threads(merge, thread_shares(len(base), _MERGE_PER_THREAD))
    return out


def kernel_operands(x: TensorInputs) -> tuple[tuple[np.ndarray, ...], np.ndarray, torch.Tensor]:
    """What a compiled merge takes of ``x`` on the CPU: the K clients' flat arrays as a tuple (padded at the
    kernel's call, ``cpu_kernels.padded``: compiled once per padded length and dtype and cached on disk; a numba
    typed list compiled its own methods anew in every process, 0.17 s each time) and the base's, all float32 or
    all float64 (else widened to float64), and the tensor to merge into (``x.out``, else a new float64 one)."""
    assert x.base is not None
    tensors = [*(x.stack.unbind(0) if x.stack is not None else x.tensors), x.base]
    if len({t.dtype for t in tensors}) > 1 or tensors[0].dtype not in (torch.float32, torch.float64):
        tensors = [t.to(torch.float64) for t in tensors]
    *clients, base = (t.reshape(-1).numpy() for t in tensors)
    out = x.out if x.out is not None else torch.empty(x.base.shape, dtype=torch.float64, device=x.base.device)
    return tuple(clients), base, out


def masked_merge_eager(x: TensorInputs, coefficient: float, combine: str, divisor: float | None = None) -> torch.Tensor:
    """:func:`masked_merge` in torch ops, on any device."""
    assert x.base is not None and x.masks is not None
    base = x.base.to(torch.float64)
    tasks = (x.stacked().to(torch.float64) - base).mul_(x.masks)
    if divisor is not None:
        tasks.div_(divisor)
    if combine == "sum":
        total = running_sum(tasks)
    else:
        total, count = agreeing_sum(tasks, overwrite=True)
        if combine == "agreeing_mean":
            total.div_(count.clamp_(min=1))
    return base + coefficient * total


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
