"""The exact merge on a device: D = 1M parameters, K = 5 clients, N = 256 factor rows each (bench/exact_speed.py's
synthetic clients), against the same merge on the CPU.

Usage: python bench/gpu_exact.py [--device auto] [--dim 1048576] [--clients 5] [--rows 256] [--repeats 3] [--cpu]

The clients are made on the CPU and moved to the device; the merge is timed from device tensors to device
tensors (synchronised before each clock read), best of ``--repeats`` after one warm-up. ``--cpu`` also times
it on the CPU and prints the relative difference of the two merged models. Target (issue 32): ≤ 0.25 s on an
H100 at the default sizes. Tiny sizes run anywhere: ``--dim 65536 --rows 32``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from exact_speed import flat, synthetic_clients  # bench/ is the script's folder

from mergeflow.device import device_name, resolve_device
from mergeflow.merge import run_merge


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, object]:
    """(best seconds of ``repeats`` after one warm-up, the last result)."""
    result = fn()  # warm-up: CUDA context, kernels, allocator
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dim", type=int, default=1 << 20)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="also time the CPU and compare the results")
    args = parser.parse_args()
    device = resolve_device(args.device)
    states, fishers, factors, sizes = synthetic_clients(args.dim, args.clients, args.rows, zero_fraction=0.1)

    def merge_on(where: torch.device) -> Callable[[], dict[str, torch.Tensor]]:
        moved = {
            "states": [{k: v.to(where) for k, v in s.items()} for s in states],
            "fishers": [{k: v.to(where) for k, v in f.items()} for f in fishers],
            "factors": [u.to(where) for u in factors],
        }
        return lambda: run_merge("exact", weights=sizes, prior_precision=1e-3, **moved).state

    print(f"device: {device} ({device_name(device)}), torch {torch.__version__}")
    print(f"exact merge, D = {args.dim:,}, K = {args.clients}, N = {args.rows}")
    seconds, merged = timed(merge_on(device), device, args.repeats)
    print(f"  {device_name(device)}: {seconds:.3f} s (best of {args.repeats})")
    if args.cpu and device.type != "cpu":
        cpu_seconds, cpu_merged = timed(merge_on(torch.device("cpu")), torch.device("cpu"), 1)
        a, b = flat({k: v.cpu() for k, v in merged.items()}), flat(cpu_merged)
        print(f"  cpu ({torch.get_num_threads()} threads): {cpu_seconds:.3f} s; {cpu_seconds / seconds:.1f}x")
        print(f"  relative difference to the CPU's merge: {float((a - b).norm() / b.norm()):.2e}")


if __name__ == "__main__":
    main()
