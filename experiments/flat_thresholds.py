"""IVON-ADMM's stable region for a parameter no data touches: the smallest stable ρ per setting.

Usage (from the project root, after ``make install``):
    .venv/bin/python experiments/flat_thresholds.py [--sizes 188 243 248 332 246] [--rounds 200]

Runs the closed-form recursion of :mod:`mergeflow.federated.flat_direction` (no data, no model:
about 20 s for the whole table on 2 cores) for the settings of docs/results.md, at 2 and 10 local epochs of
batches of 32. The default sizes are the default pipeline's clients (``metrics/partition.json``
of ``make run``: digits, 5 clients, Dirichlet 0.5, seed 0); pass a run's own sizes to map it.
"""

from __future__ import annotations

import argparse

from mergeflow.federated.flat_direction import local_steps, min_stable_rho
from mergeflow.schema.federated import BayesADMMOptions

OLD = {"temperature": 1.0, "lr": 0.2, "hess_init": 1.0, "beta2": 0.99, "damping": 0.1, "prior_precision": 1.0}
SMALLEST = 0.02  # the search starts here
SETTINGS = {
    "old defaults (τ 1, lr 0.2, hess_init 1, β2 0.99)": OLD,
    "old, lr 0.05": OLD | {"lr": 0.05},
    "old, lr 0.1": OLD | {"lr": 0.1},
    "old, hess_init 0.1": OLD | {"hess_init": 0.1},
    "old, hess_init 0.01": OLD | {"hess_init": 0.01},
    "old, damping 0.3": OLD | {"damping": 0.3},
    "old, β2 0.999": OLD | {"beta2": 0.999},
    "new defaults": {},
}


def main() -> None:
    """Print the smallest stable ρ and K·ρ of every setting at 2 and 10 local epochs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[188, 243, 248, 332, 246])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    k = len(args.sizes)
    print(f"| setting | ρ_min, 2 epochs | K·ρ | ρ_min, 10 epochs | K·ρ |  (K = {k}, {args.rounds} rounds)")
    print("|---|---:|---:|---:|---:|")
    for name, changes in SETTINGS.items():
        cells = []
        for epochs in (2, 10):
            options = BayesADMMOptions(**changes).model_copy(update={"rho": SMALLEST})
            rho = min_stable_rho(args.sizes, local_steps(args.sizes, epochs, 32), options, args.rounds)
            below = "≤ " if rho == SMALLEST else ""  # stable at the smallest ρ searched
            cells += [f"{below}{rho:.3f}", f"{below}{k * rho:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
