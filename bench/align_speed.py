"""Time to align two MLPs (64 → w → w → 10) by weight matching and by activation matching, for growing w.

Usage: python bench/align_speed.py [--repeats 3] [--threads 1] [--widths 64 128 256 512 1024]

- weight matching: Git Re-Basin coordinate descent from two independent initialisations
  (seeds 0 and 1), float64, until a sweep improves nothing; the sweep count is printed;
- activation matching: Pearson correlation of the post-ReLU activations on 512 digits images,
  one linear assignment per hidden layer.

Each timing is the best of ``--repeats`` runs; ratios are to the first width, all from one run.
One torch thread by default: the assignment solver (scipy) is single-threaded anyway, and on a
shared machine more threads mostly add noise.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from sklearn.datasets import load_digits

from mergeflow.align import activation_matching, permutation_spec, weight_matching
from mergeflow.models.sequential import build_model

N_INPUTS = 512


def best_of(repeats: int, fn) -> tuple[float, object]:
    """The fastest of ``repeats`` wall times of ``fn()`` in seconds, and its last result."""
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return min(times), result


def time_width(width: int, inputs: torch.Tensor, repeats: int) -> tuple[int, float, int, float]:
    """(width, weight-matching seconds, sweeps, activation-matching seconds) for one width."""
    a, b = (build_model("mlp", [64], 10, widths=[width, width], seed=seed) for seed in (0, 1))
    spec = permutation_spec(a, [64])
    state_a, state_b = a.state_dict(), b.state_dict()
    wm_time, result = best_of(repeats, lambda: weight_matching(spec, state_a, state_b, seed=0))
    assert np.all(np.diff(result.objectives) >= -1e-9 * abs(result.objectives[0])), "objective decreased"
    am_time, _ = best_of(repeats, lambda: activation_matching(spec, a, b, inputs, batch_size=len(inputs)))
    return width, wm_time, len(result.objectives) - 1, am_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    digits = load_digits()
    rows = np.random.default_rng(0).choice(len(digits.target), size=N_INPUTS, replace=False)
    inputs = torch.from_numpy((digits.data[rows] / 16.0).astype(np.float32))

    table = [time_width(width, inputs, args.repeats) for width in args.widths]
    wm0, am0 = table[0][1], table[0][3]
    print(f"torch threads: {args.threads}, best of {args.repeats}, activation matching on {N_INPUTS} inputs")
    header = ("width", 6), ("weight match (s)", 17), ("ratio", 7), ("sweeps", 6), ("s/sweep", 8)
    print(" ".join(f"{name:>{size}}" for name, size in (*header, ("act. match (s)", 15), ("ratio", 7))))
    for width, wm_time, sweeps, am_time in table:
        print(
            f"{width:>6} {wm_time:>17.4f} {wm_time / wm0:>7.1f} {sweeps:>6} {wm_time / sweeps:>8.4f}"
            f" {am_time:>15.4f} {am_time / am0:>7.1f}"
        )


if __name__ == "__main__":
    main()
