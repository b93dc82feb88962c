"""Where a streamed mask method's time goes: drawing the masks (whole task vectors) against merging blocks.

Usage: python bench/sparsify_parts.py DIR [--method ties] [--models 4] [--runs 1] [options as key=value ...]

DIR holds ``base`` and ``model_k`` HF directories (``bench/streaming_merge.py --keep`` leaves them).
Runs ``merge_files`` ``--runs`` times in one process with 2 torch threads and prints, for each run, wall
and CPU seconds of the whole merge, of the mask draws and of the method's block merges (the first run
also loads the compiled CPU kernels, about 0.45 s; later runs show a process that merged before).
Run it alternately on two trees (``PYTHONPATH``) to compare them on a shared machine, where single
runs vary by 2-4x.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import tempfile
import time

import torch

import mergeflow.merge.streaming as streaming
from mergeflow.merge import METHODS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--method", default="ties")
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--runs", type=int, default=1, help="merges in this one process (the first loads the kernels)")
    parser.add_argument("options", nargs="*", help="key=value, e.g. density=0.2")
    args = parser.parse_args()
    options = {k: float(v) for k, v in (o.split("=") for o in args.options)}
    torch.set_num_threads(2)
    spent = {"masks": [0.0, 0.0], "blocks": [0.0, 0.0]}

    def timed(part, fn):
        def run(*a, **k):
            wall, cpu = time.perf_counter(), time.process_time()
            result = fn(*a, **k)
            spent[part][0] += time.perf_counter() - wall
            spent[part][1] += time.process_time() - cpu
            return result

        return run

    streaming._Masks.draw = timed("masks", streaming._Masks.draw)
    declaration = METHODS[args.method]
    module, _, attr = declaration.implementation.partition(":")
    setattr(importlib.import_module(module), attr, timed("blocks", declaration.load()))  # what the engine then loads
    models = [f"{args.dir}/model_{k}" for k in range(args.models)]
    base = {"base": f"{args.dir}/base"} if "base" in declaration.needs else {}
    for run in range(args.runs):
        for part in spent.values():
            part[:] = [0.0, 0.0]
        out = tempfile.mkdtemp()
        try:
            wall, cpu = time.perf_counter(), time.process_time()
            streaming.merge_files(args.method, models, f"{out}/merged", **base, **options)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        finally:
            shutil.rmtree(out)
        parts = ", ".join(f"{part} {w:.2f} s wall / {c:.2f} s CPU" for part, (w, c) in spent.items())
        print(f"{args.method} (run {run + 1}): {wall:.2f} s wall / {cpu:.2f} s CPU; {parts}")


if __name__ == "__main__":
    main()
