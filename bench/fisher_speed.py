"""Diagonal Fisher over N = 2048 digits examples on the default MLP, four ways, side by side.

Usage: python bench/fisher_speed.py [--repeats 5]

- a per-example backward loop (the obvious way, and the baseline);
- ``torch.func`` vmap of per-example gradients (mergeflow's fallback backend);
- BackPACK (mergeflow's default backend), empirical and exact kinds;
- one plain training epoch over the same examples (batch 32, SGD), for scale.

Each timing is the best of ``--repeats`` runs, with 2 torch threads (CI's machine size).
The ratios are printed; record them in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from sklearn.datasets import load_digits

from mergeflow.fisher import diagonal_fisher
from mergeflow.models.sequential import build_model
from mergeflow.training import train

N = 2048


def best_of(repeats: int, fn) -> float:
    """The fastest of ``repeats`` wall times of ``fn()``, in seconds."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def loop_fisher(model: torch.nn.Module, X: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Empirical diagonal Fisher by one backward pass per example."""
    totals = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(len(X)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(X[i : i + 1]), y[i : i + 1]).backward()
        for n, p in model.named_parameters():
            totals[n] += p.grad**2
    return {n: t / len(X) for n, t in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    digits = load_digits()
    rng = np.random.default_rng(0)
    rows = rng.choice(len(digits.target), size=N, replace=True)  # digits has 1797 rows
    X = (digits.data[rows] / 16.0).astype(np.float32)
    y = digits.target[rows]
    model = build_model("mlp", [64], 10, widths=[64])
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y)

    reference = loop_fisher(model, Xt, yt)
    for backend in ("functorch", "backpack"):
        check = diagonal_fisher(model, X, y, kind="empirical", backend=backend, batch_size=N)
        error = max(float((check[n] - reference[n]).abs().max() / reference[n].abs().max()) for n in reference)
        assert error < 1e-4, f"{backend} disagrees with the loop: {error}"

    cases = {
        "per-example backward loop": lambda: loop_fisher(model, Xt, yt),
        "torch.func vmap (empirical)": lambda: diagonal_fisher(
            model, X, y, kind="empirical", backend="functorch", batch_size=N
        ),
        "BackPACK empirical": lambda: diagonal_fisher(model, X, y, kind="empirical", backend="backpack", batch_size=N),
        "BackPACK exact": lambda: diagonal_fisher(model, X, y, kind="exact", backend="backpack", batch_size=N),
        "one training epoch (batch 32)": lambda: train(
            build_model("mlp", [64], 10, widths=[64]), X, y, task="classification", epochs=1, lr=0.05, batch_size=32
        ),
    }
    seconds = {name: best_of(args.repeats, fn) for name, fn in cases.items()}
    loop, epoch = seconds["per-example backward loop"], seconds["one training epoch (batch 32)"]
    print(f"N = {N}, MLP 64-64-10, {torch.get_num_threads()} threads, best of {args.repeats}")
    print("| way | seconds | loop ÷ this | this ÷ epoch |\n|---|---:|---:|---:|")
    for name, value in seconds.items():
        print(f"| {name} | {value:.4f} | {loop / value:.1f} | {value / epoch:.2f} |")


if __name__ == "__main__":
    main()
