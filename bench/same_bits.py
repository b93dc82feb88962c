"""Whether two mergeflow trees merge bit for bit alike: a speed change checked against the code before it.

Usage: python bench/same_bits.py OLD_TREE NEW_TREE [--methods ties dare_linear dare_ties] [--files DIR]

Each tree (e.g. ``git archive HEAD | tar -x -C /tmp/old``) merges, in its own interpreter, in-memory
float64 state dicts (tensors from 3 to 5M entries, some of them rounded so magnitudes tie at the cuts,
zeros included) and, with ``--files``, the GPT-2 checkpoints that ``bench/streaming_merge.py --keep``
leaves in DIR (streamed, K = 4). Prints, per method and case, whether every output tensor has the same
bits (``torch.equal`` of the int64/int32 views, so −0 ≠ +0).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

_MERGE = """
import sys, torch
from pathlib import Path
from mergeflow.merge import merge
from mergeflow.merge.streaming import merge_files
methods, out, files = sys.argv[1].split(","), Path(sys.argv[2]), sys.argv[3]
import mergeflow.merge.engine
assert mergeflow.merge.engine.__file__.startswith(sys.argv[4]), f"imported {mergeflow.merge.engine.__file__}"
generator = torch.Generator().manual_seed(0)
shapes = {"tiny": (3,), "small": (40, 50), "mid": (300, 400), "radix": (5_000_001,)}
def state(scale):
    s = {k: torch.randn(shape, generator=generator, dtype=torch.float64) * scale for k, shape in shapes.items()}
    s["mid"] = s["mid"].round(decimals=1)  # ties at the cut
    s["radix"][:1_000_000] = 0.0
    return s
base = state(1.0)
states = [{k: v + d for (k, v), d in zip(base.items(), state(0.1).values())} for _ in range(4)]
options = {"ties": {"density": 0.2}, "dare_linear": {"drop_rate": 0.9}, "dare_ties": {"drop_rate": 0.9}}
for method in methods:
    torch.save(merge(method, states, base=base, **options.get(method, {})), out / f"{method}.pt")
    if files:
        d = Path(files)
        merge_files(method, [d / f"model_{k}" for k in range(4)], out / f"{method}-files", base=d / "base",
                    **options.get(method, {}))
"""


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[tensor.element_size()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--methods", nargs="+", default=["ties", "dare_linear", "dare_ties"])
    parser.add_argument("--files", default="")
    args = parser.parse_args()
    from mergeflow.hf_checkpoints import open_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        outs = []
        for tree in (args.old, args.new):
            out = Path(tmp) / Path(tree).name
            out.mkdir()
            env = {"PYTHONPATH": tree, "PATH": "/usr/bin:/bin"}
            # run in the tree: ``-c`` puts the working directory first on the path, ahead of PYTHONPATH, so a
            # run from a checkout would import that checkout for both trees
            tree_path = str(Path(tree).resolve())
            command = [sys.executable, "-c", _MERGE, ",".join(args.methods), str(out), args.files, tree_path]
            subprocess.run(command, env=env, cwd=tree_path, check=True)
            outs.append(out)
        for method in args.methods:
            old, new = (torch.load(o / f"{method}.pt") for o in outs)
            same = all(torch.equal(bits(old[k]), bits(new[k])) for k in old)
            print(f"{method}, in memory: {'same bits' if same else 'DIFFERENT'}")
            if args.files:
                a, b = (open_checkpoint(o / f"{method}-files") for o in outs)
                same = all(torch.equal(bits(a[k]), bits(b[k])) for k in a)
                print(f"{method}, streamed GPT-2 files: {'same bits' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
