"""Where a streamed mask method's time goes: drawing the masks (whole task vectors) against merging blocks.

Usage: python bench/sparsify_parts.py DIR [--method ties] [--models 4] [--runs 1] [--kernels]
                                      [options as key=value ...]

DIR holds ``base`` and ``model_k`` HF directories (``bench/streaming_merge.py --keep`` leaves them).
Runs ``merge_files`` ``--runs`` times in one process with 2 torch threads and prints, for each run, wall
and CPU seconds of the whole merge, of the mask draws and of the method's block merges (the first run
also loads the compiled CPU kernels, about 0.45 s; later runs show a process that merged before).
Run it alternately on two trees (``PYTHONPATH``) to compare them on a shared machine, where single
runs vary by 2-4x.

``--kernels`` loads numba and the compiled kernels before the runs and times that start-up on its own
(numba's import, the kernels' module's, and a first call, which builds numba's typing and target
contexts); each run then also prints every compiled kernel's seconds summed over the threads that ran
it (about its CPU seconds: the kernels never wait) and per client entry (the K models' entries).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

import mergeflow.merge.streaming as streaming
from mergeflow.merge import METHODS
from mergeflow.merge.sparsify import kernels

# The compiled entry points the sparsifying methods call, each looked up as ``cpu_kernels.NAME`` at call time.
KERNELS = ("sample_ranks", "split", "finish", "masked_merge", "skip", "uniforms_below", "della_merge", "della_keep")


def start_up() -> dict[str, float]:
    """Seconds to import numba, to import the kernels' module, and of a first kernel call (from numba's cache)."""
    started = time.perf_counter()
    import numba  # noqa: F401

    imported = time.perf_counter()
    cpu_kernels = kernels()
    loaded = time.perf_counter()
    tiny = np.ones(8, np.float32)
    cpu_kernels.sample_ranks(tiny, tiny, 1, 1)
    first_call = time.perf_counter() - loaded
    return {"numba import": imported - started, "kernels' module": loaded - imported, "first call": first_call}


def entries(directory: str) -> int:
    """The entries of every tensor of the HF directory ``directory``."""
    total = 0
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            total += sum(int(np.prod(f.get_slice(key).get_shape())) for key in f.keys())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--method", default="ties")
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--runs", type=int, default=1, help="merges in this one process (the first loads the kernels)")
    parser.add_argument("--kernels", action="store_true", help="time the start-up apart, and each compiled kernel")
    parser.add_argument("options", nargs="*", help="key=value, e.g. density=0.2")
    args = parser.parse_intermixed_args()
    options = {k: float(v) for k, v in (o.split("=") for o in args.options)}
    torch.set_num_threads(2)
    spent = {"masks": [0.0, 0.0], "blocks": [0.0, 0.0]}
    in_kernels: defaultdict[str, float] = defaultdict(float)

    def timed(part, fn):
        def run(*a, **k):
            wall, cpu = time.perf_counter(), time.process_time()
            result = fn(*a, **k)
            spent[part][0] += time.perf_counter() - wall
            spent[part][1] += time.process_time() - cpu
            return result

        return run

    def in_kernel(name, fn):
        def run(*a, **k):
            wall = time.perf_counter()
            result = fn(*a, **k)
            in_kernels[name] += time.perf_counter() - wall  # from any thread: summed over them
            return result

        return run

    if args.kernels:
        parts = ", ".join(f"{part} {seconds:.3f} s" for part, seconds in start_up().items())
        print(f"start-up, before the runs: {parts}")
        cpu_kernels = kernels()
        for name in KERNELS:
            setattr(cpu_kernels, name, in_kernel(name, getattr(cpu_kernels, name)))
    streaming._Masks.draw = timed("masks", streaming._Masks.draw)
    declaration = METHODS[args.method]
    module, _, attr = declaration.implementation.partition(":")
    setattr(importlib.import_module(module), attr, timed("blocks", declaration.load()))  # what the engine then loads
    models = [f"{args.dir}/model_{k}" for k in range(args.models)]
    base = {"base": f"{args.dir}/base"} if "base" in declaration.needs else {}
    client_entries = entries(f"{args.dir}/base") * args.models
    for run in range(args.runs):
        for part in spent.values():
            part[:] = [0.0, 0.0]
        in_kernels.clear()
        out = tempfile.mkdtemp()
        try:
            wall, cpu = time.perf_counter(), time.process_time()
            streaming.merge_files(args.method, models, f"{out}/merged", **base, **options)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        finally:
            shutil.rmtree(out)
        parts = ", ".join(f"{part} {w:.2f} s wall / {c:.2f} s CPU" for part, (w, c) in spent.items())
        print(f"{args.method} (run {run + 1}): {wall:.2f} s wall / {cpu:.2f} s CPU; {parts}")
        if args.kernels:
            each = [f"{name} {s:.3f} s ({s / client_entries * 1e9:.2f} ns)" for name, s in in_kernels.items()]
            total = sum(in_kernels.values())
            print(f"  kernels, summed over threads (ns a client entry of {client_entries:,}): {', '.join(each)};")
            ns = total / client_entries * 1e9
            print(f"  all kernels {total:.3f} s ({ns:.2f} ns), outside them {cpu - total:.2f} s CPU")


if __name__ == "__main__":
    main()
