"""Streaming merges of K GPT-2 checkpoints on a device against the same merges on the CPU.

Usage: python bench/gpu_streaming.py [--device auto] [--models 4] [--n-layer 12] [--dir DIR]
                                     [--methods average ties dare_ties model_stock] [--repeats 2]

Writes the checkpoints of ``bench/streaming_merge.py`` (``GPT2Config()``: 124M parameters, float32, HF
directories sharded at 200MB; kept in ``--dir`` between runs), reads them once so that every case finds
them in the page cache, then times ``merge_files`` (default options) into an HF directory on the device and on the CPU
(every core: the CPU path merges blocks on one thread while the reader converts the next, and draws
masks on all), best of ``--repeats``. For deterministic methods it prints the largest difference between
the two outputs; DARE's draws are the device's own (reproducible per kind of device), so for it the
device's output is compared with a second device run. Issue 32 asks for this figure; record it in
docs/benchmarks.md with the card's name.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from streaming_merge import warm, write_checkpoints  # bench/ is the script's folder

from mergeflow.device import device_name, resolve_device
from mergeflow.merge.streaming import merge_files

DRAWS = {"dare_linear", "dare_ties", "della", "della_linear"}


def merged_state(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's shards."""
    return {k: v for shard in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(shard)).items()}


def run(method: str, models: list[str], base: str, out: Path, device: torch.device, repeats: int) -> float:
    """Best seconds of ``repeats`` streamed merges into ``out``."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        merge_files(method, models, out, base=base, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--dir", default="")
    parser.add_argument("--methods", nargs="+", default=["average", "ties", "dare_ties", "model_stock"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    device = resolve_device(args.device)
    root = Path(args.dir or tempfile.mkdtemp(prefix="gpu-streaming-"))
    root.mkdir(parents=True, exist_ok=True)
    models, base, _ = write_checkpoints(root, args.models, args.n_layer, "200MB")
    warm([*models, base])
    print(f"device: {device} ({device_name(device)}), torch {torch.__version__}, cpu threads {torch.get_num_threads()}")
    print(f"streamed merges of K = {args.models} GPT-2 checkpoints ({args.n_layer} layers), best of {args.repeats}")
    print(f"{'method':<14}{'device s':>10}{'cpu s':>10}{'ratio':>8}  check")
    for method in args.methods:
        on_device, on_cpu, again = root / f"{method}-device", root / f"{method}-cpu", root / f"{method}-again"
        device_seconds = run(method, models, base, on_device, device, args.repeats)
        cpu_seconds = run(method, models, base, on_cpu, torch.device("cpu"), 1)
        a = merged_state(on_device)
        if method in DRAWS:  # the device's own draws: the same seed must give the same merge there
            merge_files(method, models, again, base=base, device=device)
            b = merged_state(again)
            check = "same bits on a second device run" if all(torch.equal(a[k], b[k]) for k in a) else "DIFFERS"
        else:
            b = merged_state(on_cpu)
            worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())
            check = f"max |device - cpu| {worst:.1e}"
        print(f"{method:<14}{device_seconds:>10.2f}{cpu_seconds:>10.2f}{cpu_seconds / device_seconds:>7.1f}x  {check}")


if __name__ == "__main__":
    main()
