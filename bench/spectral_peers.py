"""Karcher, TSV-M, Iso-C and Iso-CTS side by side with their peers' own code, on the same tensors.

Usage: python bench/spectral_peers.py [--mergekit-python /tmp/mk-venv/bin/python]
                                      [--fusionbench-python /tmp/fb-venv/bin/python] [--dir DIR]

The peers run in their own venvs (never dependencies of mergeflow), each in a subprocess that reads the
inputs from a ``torch.save`` file and writes its outputs to another:

- mergekit 0.1.5 (``python3 -m venv /tmp/mk-venv && /tmp/mk-venv/bin/pip install torch==2.13.0
  mergekit==0.1.5``):
  1. ``mergekit.merge_methods.karcher.karcher_merge_tensors`` on float64 tensors (K = 2, 3, 5; one case
     with a zero tensor, one with nearly parallel tensors) against ``merge("karcher", ...)``;
  2. ``mergekit-yaml`` with ``karcher`` (K = 3) and ``multislerp`` (K = 2, equal weights) on tiny float32
     GPT-2 checkpoints against ``merge_files("karcher", ...)`` streamed from the same files.
- FusionBench 0.2.33 (``/tmp/fb-venv``: ``pip install torch==2.13.0`` and ``pip install --no-deps
  fusion-bench==0.2.33`` plus the modules its package import asks for): ``iso_c``, ``iso_cts``
  (``fusion_bench.method.isotropic_merging.iso_utils``) and ``compute_and_sum_svd_mem_reduction``
  (``fusion_bench.method.task_singular_vector.utils.TSVM_utils``, what ``TaskSingularVectorMerging``
  calls) on float64 task vectors of a state dict with 2-D matrices (square, tall, wide), a bias and a
  4-D convolution kernel, K = 2, 3, 5; the merge is base + α·(their merged task vector), as their
  ``run`` methods do. Against ``merge("tsv" | "iso_c" | "iso_cts", ...)``.

It prints, per case, the largest absolute difference and that relative to the largest output entry.
Record the output in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import torch
from gpt2_files import noisy_gpt2s  # bench/ is the script's folder

from mergeflow.merge import merge
from mergeflow.merge.streaming import merge_files

_MERGEKIT_KARCHER = """
import sys, torch
from mergekit.merge_methods.karcher import karcher_merge_tensors
cases = torch.load(sys.argv[1])
out = {name: karcher_merge_tensors(ts, [1.0 / len(ts)] * len(ts), max_iter=it, tol=tol)
       for name, (ts, it, tol) in cases.items()}
torch.save(out, sys.argv[2])
"""

_FUSIONBENCH = """
import contextlib, io, sys, torch
from fusion_bench.method.isotropic_merging.iso_utils import iso_c, iso_cts
from fusion_bench.method.task_singular_vector.utils.TSVM_utils import compute_and_sum_svd_mem_reduction
cases = torch.load(sys.argv[1])
out = {}
with contextlib.redirect_stdout(io.StringIO()):
    for name, (base, tasks, alpha) in cases.items():
        for method, tv in (
            ("iso_c", iso_c(tasks, accelerator="cpu")),
            ("iso_cts 0.8", iso_cts(tasks, common_space_fraction=0.8, accelerator="cpu")),
            ("iso_cts 0.5", iso_cts(tasks, common_space_fraction=0.5, accelerator="cpu")),
            ("tsv", compute_and_sum_svd_mem_reduction(tasks, accelerator="cpu")),
        ):
            out[(name, method)] = {k: base[k] + alpha * tv[k] for k in base}
torch.save(out, sys.argv[2])
"""


def run_peer(python: str, code: str, inputs: object, directory: Path) -> dict:
    """Run ``code`` in a peer's interpreter on ``inputs``; its outputs."""
    source, result = directory / "peer_in.pt", directory / "peer_out.pt"
    torch.save(inputs, source)
    subprocess.run([python, "-c", code, str(source), str(result)], check=True)
    return torch.load(result)


def report(name: str, ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    """One table row: the largest difference over the state dict, absolute and relative."""
    worst = max(float((ours[k].double() - theirs[k].double()).abs().max()) for k in ours)
    scale = max(float(theirs[k].double().abs().max()) for k in ours)
    print(f"| {name} | {worst:.2e} | {worst / scale:.2e} |")


def karcher_cases() -> dict[str, tuple[list[torch.Tensor], int, float]]:
    """Float64 tensors for mergekit's karcher function: (tensors, max_iter, tol) per case."""
    generator = torch.Generator().manual_seed(0)
    shared = torch.randn(24, 16, generator=generator, dtype=torch.float64)
    cases = {}
    for count in (2, 3, 5):
        tensors = [shared + torch.randn(24, 16, generator=generator, dtype=torch.float64) for _ in range(count)]
        cases[f"K={count}, max_iter 10"] = ([t * (1 + k) for k, t in enumerate(tensors)], 10, 1e-5)
        cases[f"K={count}, max_iter 100, tol 1e-10"] = (tensors, 100, 1e-10)
    cases["K=3 with a zero tensor"] = ([shared, torch.zeros_like(shared), -0.5 * shared + 0.1], 10, 1e-5)
    cases["K=3 nearly parallel"] = ([shared, shared * 2 + 1e-7, shared * 3], 10, 1e-5)
    return cases


def compare_mergekit_functions(python: str, directory: Path) -> None:
    cases = karcher_cases()
    theirs = run_peer(python, _MERGEKIT_KARCHER, cases, directory)
    print("\n| karcher: mergekit's function, float64 | largest difference | relative |\n|---|---|---|")
    for name, (tensors, max_iter, tol) in cases.items():
        ours = merge("karcher", [{"w": t} for t in tensors], max_iter=max_iter, tol=tol)
        report(name, ours, {"w": theirs[name]})


def tiny_gpt2(directory: Path, count: int) -> list[str]:
    """``count`` float32 GPT-2 checkpoints (2 layers, width 64): a random model plus independent noise each."""
    return noisy_gpt2s(directory, count, 0.05, vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)


def compare_mergekit_files(python: str, directory: Path) -> None:
    import yaml
    from safetensors.torch import load_file

    models = tiny_gpt2(directory, 3)
    mergekit = str(Path(python).parent / "mergekit-yaml")
    print("\n| mergekit-yaml against merge_files, float32 GPT-2 | largest difference | relative |\n|---|---|---|")
    runs = (("karcher", models, {"max_iter": 10, "tol": 1e-5}), ("multislerp", models[:2], {}))
    for method, used, parameters in runs:
        config = {
            "merge_method": method,
            "models": [
                {"model": m, "parameters": {"weight": 1.0}} if method == "multislerp" else {"model": m} for m in used
            ],  # fmt: skip
            "parameters": parameters,
            "dtype": "float32",
        }
        (directory / f"{method}.yml").write_text(yaml.safe_dump(config))
        out = directory / f"mergekit_{method}"
        subprocess.run([mergekit, str(directory / f"{method}.yml"), str(out), "--no-copy-tokenizer"], check=True,
                       capture_output=True)  # fmt: skip
        ours_path = directory / f"mergeflow_karcher_{len(used)}.safetensors"
        merge_files("karcher", used, ours_path, max_iter=10, tol=1e-5)
        theirs = {}
        for shard in sorted(out.glob("*.safetensors")):
            theirs |= load_file(shard)
        ours = load_file(ours_path)
        report(f"{method} (K={len(used)}) vs mergeflow karcher", {k: ours[k] for k in theirs}, theirs)


def spectral_cases() -> dict[str, tuple[dict, list[dict], float]]:
    """(base, task vectors, α) per K: float64 state dicts with matrices, a bias and a convolution kernel."""
    shapes = {"square": (16, 16), "tall": (24, 12), "wide": (10, 30), "bias": (12,), "conv": (6, 3, 3, 3)}
    generator = torch.Generator().manual_seed(1)
    base = {k: torch.randn(s, generator=generator, dtype=torch.float64) for k, s in shapes.items()}
    shared = {k: torch.randn(s, generator=generator, dtype=torch.float64) for k, s in shapes.items()}
    cases = {}
    for count in (2, 3, 5):
        tasks = [
            {k: 0.5 * shared[k] + torch.randn(s, generator=generator, dtype=torch.float64) for k, s in shapes.items()}
            for _ in range(count)
        ]
        cases[f"K={count}"] = (base, tasks, 0.7)
    return cases


def compare_fusionbench(python: str, directory: Path) -> None:
    cases = spectral_cases()
    theirs = run_peer(python, _FUSIONBENCH, cases, directory)
    ours_options = {
        "iso_c": ("iso_c", {}),
        "iso_cts 0.8": ("iso_cts", {"common_space_fraction": 0.8}),
        "iso_cts 0.5": ("iso_cts", {"common_space_fraction": 0.5}),
        "tsv": ("tsv", {}),
    }
    print("\n| FusionBench against mergeflow, float64, α 0.7 | largest difference | relative |\n|---|---|---|")
    for name, (base, tasks, alpha) in cases.items():
        states = [{k: base[k] + t[k] for k in base} for t in tasks]
        for label, (method, options) in ours_options.items():
            ours = merge(method, states, base=base, scaling=alpha, **options)
            report(f"{label}, {name}", ours, theirs[(name, label)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mergekit-python", default="/tmp/mk-venv/bin/python")
    parser.add_argument("--fusionbench-python", default="/tmp/fb-venv/bin/python")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.dir or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        if Path(args.mergekit_python).is_file():
            compare_mergekit_functions(args.mergekit_python, directory)
            compare_mergekit_files(args.mergekit_python, directory)
        else:
            print(f"{args.mergekit_python} not found: no mergekit rows")
        if Path(args.fusionbench_python).is_file():
            compare_fusionbench(args.fusionbench_python, directory)
        else:
            print(f"{args.fusionbench_python} not found: no FusionBench rows")


if __name__ == "__main__":
    main()
