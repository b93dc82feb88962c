"""The exact merge at about 1M parameters, K = 5 clients, N = 256 factor rows each, against the diagonal Fisher merge.

Usage: python bench/exact_speed.py [--dim 1048576] [--clients 5] [--rows 256] [--max-iterations 500]
                                   [--zero-fraction 0.1] [--threads 2] [--preconditioners woodbury jacobi none]

Synthetic float32 clients with the structure of real ones:

- per-coordinate gradient scales are log-normal (layers differ by orders of magnitude), and a
  ``--zero-fraction`` of coordinates has zero Fisher in every client (dead units), so only the
  prior precision δ = 1e-3 holds them: the system's condition number is then 1e6 or more;
- factors U_k (F ≈ U_kᵀU_k) are per-example gradients ÷ √N of low effective rank: a shared
  32-direction basis, a client-specific shift of it, coefficients with a 1/i spectrum, plus 10%
  isotropic noise;
- the diagonal Fisher is diag(U_kᵀU_k) plus a positive rest (it is measured on more examples).

Each exact merge runs to a 1e-6 relative residual or ``--max-iterations``; its time, CG iterations,
residual reached, peak resident memory and distance to the Woodbury solution are printed, all
ratios to the diagonal Fisher merge measured in the same run. One run per case (minutes each).
"""

from __future__ import annotations

import argparse
import gc
import threading
import time
from collections.abc import Callable

import torch

from mergeflow.merge import run_merge
from mergeflow.merge.engine import MergeResult

LATENT = 32


def rss_gib() -> float:
    """Resident memory of this process in GiB."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**30


def measured(fn: Callable[[], MergeResult]) -> tuple[float, float, MergeResult]:
    """(seconds, peak resident GiB sampled every 50 ms, result) of ``fn()``."""
    peak, done = [rss_gib()], threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak.append(rss_gib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    return seconds, max(peak), result


def synthetic_clients(
    dim: int, clients: int, rows: int, zero_fraction: float, seed: int = 0
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]], list[torch.Tensor], list[float]]:
    """Float32 states, diagonal Fishers, factors (rows × dim) and data sizes of ``clients`` clients."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(dim, generator=g))  # per-coordinate gradient scale
    scale[torch.rand(dim, generator=g) < zero_fraction] = 0.0  # dead coordinates: zero Fisher everywhere
    basis = torch.randn(LATENT, dim, generator=g) * scale
    spectrum = 1.0 / torch.arange(1, LATENT + 1, dtype=torch.float32)
    theta0 = 0.1 * torch.randn(dim, generator=g)
    cut = [0, dim // 8, dim // 2, dim - 1024, dim]  # a few "layers", as in a state dict
    names = [f"layer{i}.weight" for i in range(len(cut) - 1)]

    def as_state(v: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: v[a:b].clone() for n, a, b in zip(names, cut, cut[1:], strict=False)}

    states, fishers, factors = [], [], []
    for _ in range(clients):
        own = basis + 0.5 * torch.randn(LATENT, dim, generator=g) * scale
        u = (torch.randn(rows, LATENT, generator=g) * spectrum) @ own
        u += 0.1 * torch.randn(rows, dim, generator=g) * scale
        u /= rows**0.5
        del own
        squares = torch.zeros(dim)
        for block in torch.split(u, 64):
            squares += block.pow(2).sum(0)
        fishers.append(as_state(squares * (1 + torch.rand(dim, generator=g))))
        factors.append(u)
        states.append(as_state(theta0 + 0.01 * torch.randn(dim, generator=g)))
    sizes = [float(s) for s in torch.randint(500, 5000, (clients,), generator=g)]
    return states, fishers, factors, sizes


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """A state dict as one float64 vector (insertion order)."""
    return torch.cat([t.reshape(-1).double() for t in state.values()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=2**20)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-iterations", type=int, default=500)
    parser.add_argument("--zero-fraction", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--preconditioners", nargs="+", default=["woodbury", "jacobi", "none"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    states, fishers, factors, sizes = synthetic_clients(args.dim, args.clients, args.rows, args.zero_fraction)
    gib = sum(u.numel() * u.element_size() for u in factors) / 2**30
    print(
        f"D = {args.dim}, K = {args.clients}, N = {args.rows} float32 factor rows each ({gib:.1f} GiB), "
        f"{args.zero_fraction:.0%} zero-Fisher coordinates, δ = 1e-3, {torch.get_num_threads()} threads"
    )

    cases: dict[str, Callable[[], MergeResult]] = {
        "fisher (diagonal)": lambda: run_merge("fisher", states, weights=sizes, fishers=fishers)
    }
    for kind in args.preconditioners:
        cases[f"exact, {kind}"] = lambda kind=kind: run_merge(
            "exact",
            states,
            weights=sizes,
            fishers=fishers,
            factors=factors,
            preconditioner=kind,
            tolerance=1e-6,
            max_iterations=args.max_iterations,
        )
    rows, solutions = [], {}
    for name, fn in cases.items():
        gc.collect()
        seconds, peak, result = measured(fn)
        solutions[name] = flat(result.state)
        iterations = result.summary.get("cg_iterations", float("nan"))
        residual = result.summary.get("cg_relative_residual", float("nan"))
        rows.append((name, seconds, iterations, residual, peak))
        print(f"  {name}: {seconds:.2f} s, {iterations:.0f} iterations, residual {residual:.2e}", flush=True)
        del result
    reference = solutions.get("exact, woodbury")
    fisher_seconds = rows[0][1]
    print(
        "| merge | seconds | ÷ fisher | CG iterations | relative residual | ‖θ − θ_woodbury‖/‖θ_woodbury‖ "
        "| peak RSS GiB |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for name, seconds, iterations, residual, peak in rows:
        gap = float((solutions[name] - reference).norm() / reference.norm()) if reference is not None else float("nan")
        its = "–" if iterations != iterations else f"{iterations:.0f}"
        res = "–" if residual != residual else f"{residual:.1e}"
        print(f"| {name} | {seconds:.2f} | {seconds / fisher_seconds:.0f} | {its} | {res} | {gap:.1e} | {peak:.1f} |")


if __name__ == "__main__":
    main()
