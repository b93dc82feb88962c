"""The exact merge's Woodbury capacitance from float64 or float32 products: build time against CG iterations.

Usage: python bench/woodbury_precision.py [--dim 1048576] [--clients 5] [--rows 256] [--tolerances 1e-6 1e-12]
                                          [--threads 2]

The clients are ``bench/exact_speed.py``'s synthetic ones (log-normal scales, 10% zero-Fisher coordinates,
δ = 1e-3). For each build precision the preconditioner is built once (timed), then the exact merge's own
system (``mergeflow.merge.exact.product_system``) is solved by CG from the clients' weighted average to
each tolerance (timed; iterations and the true relative residual reached). The capacitance is summed and
factored in float64 either way and applied in float64; only its R × R products change precision. A float32
build is faster; its rounding of the scaled factors is what costs iterations, since each iteration is four
passes over the factors. One run per row; compare rows of one run.
"""

from __future__ import annotations

import argparse
import time

import torch
from exact_speed import synthetic_clients

from mergeflow.merge.engine import model_inputs
from mergeflow.merge.exact import conjugate_gradient, product_system, woodbury_preconditioner
from mergeflow.schema.merge import ExactOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=2**20)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--tolerances", type=float, nargs="+", default=[1e-6, 1e-12])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    states, fishers, factors, sizes = synthetic_clients(args.dim, args.clients, args.rows, 0.1)
    inputs = model_inputs(states, weights=sizes, fishers=fishers, factors=factors)
    system = product_system(inputs, ExactOptions())
    print(f"D = {args.dim}, K = {args.clients}, N = {args.rows} float32 factor rows each, {args.threads} threads")
    print(
        "| capacitance products | build s | tolerance | CG iterations | CG s | total s | relative residual |\n"
        "|---|---:|---:|---:|---:|---:|---:|"
    )
    for dtype in (torch.float64, torch.float32):
        started = time.perf_counter()
        preconditioner = woodbury_preconditioner(system.clients, system.delta, build_dtype=dtype)
        build = time.perf_counter() - started
        for tolerance in args.tolerances:
            started = time.perf_counter()
            theta, residuals = conjugate_gradient(
                system.matvec, system.rhs, system.start, preconditioner=preconditioner, tolerance=tolerance
            )
            solve = time.perf_counter() - started
            reached = system.relative_residual(theta)
            name = str(dtype).removeprefix("torch.")
            print(
                f"| {name} | {build:.2f} | {tolerance:.0e} | {len(residuals)} | {solve:.2f} | "
                f"{build + solve:.2f} | {reached:.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
