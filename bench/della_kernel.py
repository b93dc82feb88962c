"""DELLA's compiled CPU kernel per client entry, with and without its ranks, against torch's stable argsort.

Usage: python bench/della_kernel.py [--rows 12000] [--width 768] [--clients 4] [--repeats 5]

Times ``cpu_kernels.della_merge`` on one thread over ``--clients`` float32 stand-ins for task rows
(|x − b| of Gaussian noise, as ``bench/streaming_merge.py`` writes), least of ``--repeats``, in ns per
client entry: the whole kernel, then the same with ε = 0 (one probability for all, so no ranks: the
differences, draws, pruning and merge alone). The difference is what ranking costs. For scale, it also
times torch's stable ``argsort`` of the same rows, which the eager code ranks with.

To time another tree's kernels (the code before a change, from ``git archive``), put that tree first on
the path: ``cd /tmp/old && PYTHONPATH=/tmp/old python bench/della_kernel.py``. Without it the script
imports the installed mergeflow (an editable install: this checkout), as a script's own folder, not the
current one, heads the path.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from mergeflow.merge import cpu_kernels
from mergeflow.merge.sparsify import stream_state, tensor_generator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=12000)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(args.rows, args.width, generator=generator) * 0.02
    clients = [base + torch.randn(base.shape, generator=generator) * 0.001 for _ in range(args.clients)]
    xs, b = cpu_kernels.padded(tuple(c.reshape(-1).numpy() for c in clients)), base.reshape(-1).numpy()
    out = np.zeros(b.size)
    words, position = stream_state(tensor_generator(0, "w"))
    entries = args.clients * b.size

    def run(step: float, rows: int = args.rows) -> float:
        states, positions = np.stack([words] * args.clients), np.stack([position] * args.clients)
        started = time.perf_counter()
        cpu_kernels.della_merge(xs, b, args.width, step, 0.4, cpu_kernels.RESCALE_PROBABILITY, states, positions,
                                0, rows, 1.0, cpu_kernels.AGREEING_MEAN, out)  # fmt: skip
        return time.perf_counter() - started

    ranked, unranked = 0.2 / (args.width - 1), 0.0
    run(ranked, 2), run(unranked, 2)  # compile or load
    best = {ranked: float("inf"), unranked: float("inf")}
    for _ in range(args.repeats):
        for step in best:
            best[step] = min(best[step], run(step))
    magnitudes = (clients[0].double() - base.double()).abs()
    started = time.perf_counter()
    magnitudes.argsort(dim=1, stable=True)
    argsort = time.perf_counter() - started
    per = 1e9 / entries
    print(f"rows {args.rows} x {args.width}, K = {args.clients}, one thread, ns per client entry:")
    print(f"  kernel {best[ranked] * per:.2f}, without ranks {best[unranked] * per:.2f}, "
          f"ranks {(best[ranked] - best[unranked]) * per:.2f}; torch's stable argsort alone "
          f"{argsort * 1e9 / magnitudes.numel():.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
