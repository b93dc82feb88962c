"""DELLA's per-row ranks: torch's stable ``argsort`` against a compiled LSD radix rank, on one thread.

Usage: python bench/della_rank.py [--rows 50257] [--width 768]

DELLA ranks every row of every task vector by magnitude (equal ones by index), which dominates its
streamed time (docs/benchmarks.md). This measures an alternative for the next attempt: a per-row LSD
radix sort of the float64 bit patterns (8-bit digits, skipping the digits every key of the row shares),
stable, so its ranks equal torch's exactly (checked here). Rows are |x − b| of float32 stand-ins for a
GPT-2 embedding (``--rows`` × ``--width``). Not used by mergeflow.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
import torch


@numba.njit(nogil=True)
def row_ranks(values, ranks):  # pragma: no cover - compiled
    """``ranks[r, j]``: the stable ascending rank of ``values[r, j]`` (non-negative float64) in its row."""
    width = values.shape[1]
    keys, spare_keys = np.empty(width, np.uint64), np.empty(width, np.uint64)
    order, spare_order = np.empty(width, np.int64), np.empty(width, np.int64)
    counts = np.empty(256, np.int64)
    for r in range(values.shape[0]):
        bits = values[r].view(np.uint64)
        differing = np.uint64(0)
        for j in range(width):
            keys[j], order[j] = bits[j], j
            differing |= bits[j] ^ bits[0]
        for shift in range(0, 64, 8):
            if (differing >> np.uint64(shift)) & np.uint64(0xFF) == 0:
                continue  # every key of the row has this digit: the pass would not move anything
            counts[:] = 0
            for j in range(width):
                counts[(keys[j] >> np.uint64(shift)) & np.uint64(0xFF)] += 1
            total = 0
            for d in range(256):
                total, counts[d] = total + counts[d], total
            for j in range(width):
                d = (keys[j] >> np.uint64(shift)) & np.uint64(0xFF)
                spare_keys[counts[d]], spare_order[counts[d]] = keys[j], order[j]
                counts[d] += 1
            keys, spare_keys, order, spare_order = spare_keys, keys, spare_order, order
        for j in range(width):
            ranks[r, order[j]] = j


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50257)
    parser.add_argument("--width", type=int, default=768)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = np.random.default_rng(0)
    x = (generator.standard_normal((args.rows, args.width)) * 0.02).astype(np.float32)
    b = x + (generator.standard_normal(x.shape) * 0.001).astype(np.float32)
    magnitudes = np.abs(x.astype(np.float64) - b.astype(np.float64))
    ranks = np.empty(magnitudes.shape, np.int64)
    row_ranks(magnitudes[:2], ranks[:2])  # compile
    started = time.perf_counter()
    row_ranks(magnitudes, ranks)
    radix = time.perf_counter() - started
    started = time.perf_counter()
    order = torch.from_numpy(magnitudes).argsort(dim=1, stable=True)
    sort = time.perf_counter() - started
    expected = torch.empty_like(order).scatter_(1, order, torch.arange(args.width).expand_as(order))
    same = np.array_equal(ranks, expected.numpy())
    print(f"radix rank {radix:.3f} s, torch stable argsort {sort:.3f} s (one thread), the same ranks: {same}")


if __name__ == "__main__":
    main()
