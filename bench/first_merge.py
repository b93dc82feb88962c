"""A user's first sparsifying merge: with the kernels compiled at install (``python -m mergeflow.merge.warm``) and
without (an empty numba cache), against a warm second merge.

Usage: python bench/first_merge.py [--models 4] [--n-layer 12] [--methods ties della] [--dir DIR]

Writes K float32 GPT-2 directories and a base (``bench/gpt2_files.py``; 124M parameters at 12 layers), then
for each method runs ``merge_files`` into an HF directory, each run in a fresh interpreter with its own numba
cache directory (``NUMBA_CACHE_DIR``):

- cold: an empty cache, as a first merge after ``pip install`` without the install step;
- installed: the cache that ``python -m mergeflow.merge.warm`` filled (timed too: the install step's cost);
- warm: the same cache after that first merge: every later merge.

It prints the seconds of the ``merge_files`` call, which holds the kernels' loading or compiling (the imports
before it are not timed), per method and case. Record the output in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpt2_files import noisy_gpt2s  # noqa: E402

_CASE = """
import json, sys, time
from mergeflow.merge.streaming import merge_files
case = json.loads(sys.argv[1])
started = time.perf_counter()
merge_files(case["method"], case["models"], case["out"], base=case["base"])
print(time.perf_counter() - started)
"""


def _merge_seconds(method: str, models: list[str], base: str, out: Path, cache: Path) -> float:
    case = json.dumps({"method": method, "models": models, "base": base, "out": str(out)})
    env = os.environ | {"NUMBA_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", _CASE, case], env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--methods", nargs="+", default=["ties", "dare_ties", "breadcrumbs", "della"])
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        root = Path(folder)
        models = noisy_gpt2s(root, args.models, 0.01, save_base=True, n_layer=args.n_layer)
        base, out = str(root / "base"), root / "merged"
        installed = root / "installed-cache"
        started = time.perf_counter()
        env = os.environ | {"NUMBA_CACHE_DIR": str(installed)}
        subprocess.run([sys.executable, "-m", "mergeflow.merge.warm"], env=env, capture_output=True, check=True)
        print(f"install step (python -m mergeflow.merge.warm): {time.perf_counter() - started:.1f} s")
        print(f"K = {args.models}, {args.n_layer}-layer GPT-2 float32; seconds of the merge_files call")
        print("| method | cold (empty cache) | first after the install step | warm |")
        print("|---|---|---|---|")
        for method in args.methods:
            cold = _merge_seconds(method, models, base, out, root / f"cold-{method}")
            first = _merge_seconds(method, models, base, out, installed)
            warm = _merge_seconds(method, models, base, out, installed)
            print(f"| {method} | {cold:.2f} | {first:.2f} | {warm:.2f} |", flush=True)


if __name__ == "__main__":
    main()
