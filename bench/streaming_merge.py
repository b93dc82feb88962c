"""Streaming merge of K large safetensors checkpoints against a raw read and a naive merge.

Usage: python bench/streaming_merge.py [--models 8] [--params 50e6] [--dir /tmp/mergeflow-stream]

Writes K synthetic float32 checkpoints of about ``--params`` parameters each (50 tensors),
then times, each in a fresh subprocess so that peak RSS is its own:

- a raw read of the same files (every byte, 64 MiB at a time): the I/O floor;
- ``merge_files("average")``: mergeflow's streaming merge, tensor by tensor in and out;
- ``merge_files("fisher")`` with K Fisher files beside the checkpoints;
- ``merge_files`` with ``task_arithmetic``, ``ties``, ``dare_ties`` and ``model_stock`` (the first
  checkpoint standing in for the base model);
- a naive merge: ``load_file`` every model, stack, mean, ``save_file``.

It prints wall time as a ratio to the raw read and the peak anonymous memory the case adds
(``RssAnon`` sampled every 5 ms, less its value before the case starts; page-cache pages of the
files do not count) as a ratio to one model's size. Record the output in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CASES = {
    "raw read": """
for p in paths:
    with open(p, "rb") as f:
        while f.read(1 << 26):
            pass
""",
    "streaming average": """
merge_files("average", paths, out)
""",
    "streaming fisher": """
merge_files("fisher", paths, out, fishers=fishers, weights=[1.0] * len(paths))
""",
    "streaming task_arithmetic": """
merge_files("task_arithmetic", paths, out, base=paths[0], scaling=0.3)
""",
    "streaming ties": """
merge_files("ties", paths, out, base=paths[0], density=0.2)
""",
    "streaming dare_ties": """
merge_files("dare_ties", paths, out, base=paths[0], drop_rate=0.9)
""",
    "streaming model_stock": """
merge_files("model_stock", paths, out, base=paths[0])
""",
    "naive load + stack": """
from safetensors.torch import load_file, save_file
states = [load_file(p) for p in paths]
save_file({k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]}, out)
""",
    "import only": "",
}

_PROLOGUE = """
import json, sys, threading, time
import torch, safetensors.torch
from mergeflow.merge.streaming import merge_files
torch.set_num_threads(2)
paths, fishers, out = json.loads(sys.argv[1])


def rss_anon():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))


start_kib, peak = rss_anon(), [0]
done = threading.Event()


def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.005)


sampler = threading.Thread(target=sample)
sampler.start()
started = time.perf_counter()
"""
_EPILOGUE = """
seconds = time.perf_counter() - started
done.set()
sampler.join()
print(json.dumps({"seconds": seconds, "anon_kib": max(peak[0], rss_anon()) - start_kib}))
"""


def write_checkpoints(directory: Path, models: int, params: float) -> tuple[list[str], list[str], int]:
    """K checkpoints and K Fisher files of 50 equal float32 tensors; returns paths and model bytes."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    per_tensor = int(params) // 50
    paths, fishers = [], []
    for k in range(models):
        generator = torch.Generator().manual_seed(k)
        for kind, target in (("model", paths), ("fisher", fishers)):
            path = directory / f"{kind}_{k}.safetensors"
            if not path.exists():
                tensors = {f"layer{i}.weight": torch.rand(per_tensor, generator=generator) for i in range(50)}
                save_file(tensors, str(path))
            target.append(str(path))
    return paths, fishers, 50 * per_tensor * 4


def run_case(code: str, paths: list[str], fishers: list[str], out: str) -> dict[str, float]:
    """Run one case in a fresh interpreter; its wall time and the peak anonymous memory it added."""
    done = subprocess.run(
        [sys.executable, "-c", _PROLOGUE + code + _EPILOGUE, json.dumps([paths, fishers, out])],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=8)
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--dir", default="/tmp/mergeflow-stream")
    args = parser.parse_args()
    directory = Path(args.dir)
    paths, fishers, model_bytes = write_checkpoints(directory, args.models, args.params)
    out = str(directory / "merged.safetensors")
    results = {}
    for name, code in CASES.items():
        started = time.perf_counter()
        results[name] = run_case(code, paths, fishers, out)
        results[name]["wall"] = time.perf_counter() - started
    results.pop("import only")
    raw = results["raw read"]["seconds"]
    print(f"K = {args.models} checkpoints of {model_bytes / 2**20:.0f} MiB (float32), torch threads 2")
    print("| case | seconds | ÷ raw read | peak anonymous memory (MiB) | ÷ one model |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        extra = r["anon_kib"] * 1024
        print(
            f"| {name} | {r['seconds']:.2f} | {r['seconds'] / raw:.2f} | {extra / 2**20:.0f} | "
            f"{extra / model_bytes:.2f} |"
        )


if __name__ == "__main__":
    main()
