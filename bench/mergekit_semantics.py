"""mergeflow's Breadcrumbs and DELLA against mergekit 0.1.5 on the same checkpoints.

Usage: python bench/mergekit_semantics.py [--mergekit-python /tmp/mk-venv/bin/python] [--dir DIR]

mergekit is no dependency; its venv is made once with
    python3 -m venv /tmp/mk-venv && /tmp/mk-venv/bin/pip install torch==2.13.0 mergekit==0.1.5

Writes a small GPT-2 (n_embd 64, 2 layers, vocabulary 512; float32) as a base and K = 3 fine-tuned
stand-ins (base + noise), then for each case runs ``mergekit-yaml`` (mergekit's own process and
venv) and ``merge_files`` (mergeflow, streamed) on the same directories and compares every tensor:

- ``breadcrumbs``, ``breadcrumbs_ties``: deterministic, compared as they are.
- ``della``, ``della_linear``: the draws come from different generators, so both sides run with
  their draws (mergekit's ``torch.bernoulli(p)``, mergeflow's ``bernoulli_draws``) replaced by the
  deterministic ``p > threshold`` (keep the entries whose keep
  probability is above it). Everything else (per-row ranks, probabilities, mergekit's L1 rescale,
  sign election, normalisation, λ) is each library's own code; mergeflow uses ``rescale: l1``.
- the keep probabilities themselves: mergekit's ``della_magprune`` (its ``torch.bernoulli`` argument,
  captured) against mergeflow's ``keep_probabilities`` on every task vector of model 0.

mergekit computes task vectors in float32 (the checkpoints' dtype), mergeflow in float64 rounded once,
so results differ by rounding, and masks can differ where two magnitudes tie in float32 only.
Prints one table; record it in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from gpt2_files import noisy_gpt2s  # bench/ is the script's folder

_MERGEKIT = """
import json, sys, torch
case = json.loads(sys.argv[1])
if case["threshold"] is not None:
    torch.bernoulli = lambda p, *a, **k: (p > case["threshold"]).to(p.dtype)
from mergekit.scripts.run_yaml import main
sys.argv = ["mergekit-yaml", case["config"], case["out"], "--no-copy-tokenizer", "--quiet"]
main()
"""
_PROBABILITIES = """
import json, sys, torch
from safetensors.torch import load_file, save_file
from mergekit.sparsify import della_magprune
density, epsilon, base, model, out = json.loads(sys.argv[1])
captured = []
real = torch.bernoulli
torch.bernoulli = lambda p, *a, **k: (captured.append(p.clone()), real(p))[1]
base, model = load_file(base), load_file(model)
result = {}
for key, value in base.items():
    captured.clear()
    della_magprune(model[key] - value, density, epsilon)
    result[key] = captured[0].reshape(value.shape).contiguous()
save_file(result, out)
"""
# (name, mergeflow method, mergeflow options, mergekit parameters (global, per model), deterministic draws)
CASES = [
    ("breadcrumbs", "breadcrumbs", {"density": 0.3, "gamma": 0.05}, ({}, {"density": 0.3, "gamma": 0.05}), None),
    ("breadcrumbs λ 0.5", "breadcrumbs", {"density": 0.5, "gamma": 0.01, "scaling": 0.5},
     ({"lambda": 0.5}, {"density": 0.5, "gamma": 0.01}), None),
    ("breadcrumbs_ties", "breadcrumbs_ties", {"density": 0.3, "gamma": 0.05},
     ({}, {"density": 0.3, "gamma": 0.05}), None),
    ("breadcrumbs_ties normalize", "breadcrumbs_ties", {"density": 0.3, "gamma": 0.05, "normalize": True},
     ({"normalize": True}, {"density": 0.3, "gamma": 0.05}), None),
    ("della (draws: p > 0.45)", "della", {"density": 0.5, "epsilon": 0.2, "rescale": "l1"},
     ({}, {"density": 0.5, "epsilon": 0.2}), 0.45),
    ("della_linear λ 0.7 (draws: p > 0.45)", "della_linear",
     {"density": 0.5, "epsilon": 0.2, "rescale": "l1", "scaling": 0.7},
     ({"lambda": 0.7}, {"density": 0.5, "epsilon": 0.2}), 0.45),
]  # fmt: skip


def write_models(directory: Path, count: int) -> tuple[list[str], str]:
    """A tiny GPT-2 base and ``count`` noisy copies as HF directories (float32, one file each)."""
    config = {"n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 512, "n_positions": 128}
    return noisy_gpt2s(directory, count, 0.02, save_base=True, **config), str(directory / "base")


def compare(first: Path, second: Path) -> tuple[float, float, float]:
    """The fraction of elements more than 1e-6 apart, the largest absolute difference, and the largest entry."""
    from mergeflow.hf_checkpoints import open_checkpoint

    a, b = open_checkpoint(first), open_checkpoint(second)
    beyond = total = 0
    worst = largest = 0.0
    for key in a:
        gap = (a[key].double() - b[key].double()).abs()
        beyond += int((gap > 1e-6).sum())
        total += gap.numel()
        worst = max(worst, float(gap.max()))
        largest = max(largest, float(a[key].abs().max()))
    return beyond / total, worst, largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mergekit-python", default="/tmp/mk-venv/bin/python")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    import yaml

    from mergeflow.merge import della
    from mergeflow.merge.della import keep_probabilities
    from mergeflow.merge.streaming import merge_files

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        models, base = write_models(root, 3)
        print("| case | elements > 1e-6 apart | largest difference | largest merged entry |")
        print("|---|---:|---:|---:|")
        for name, method, options, (overall, per_model), threshold in CASES:
            slug = name.split(" ")[0] + str(CASES.index((name, method, options, (overall, per_model), threshold)))
            config = {
                "merge_method": method,
                "base_model": base,
                "models": [{"model": m, "parameters": {"weight": 1.0, **per_model}} for m in models],
                "parameters": overall,
                "dtype": "float32",
            }
            (root / f"{slug}.yml").write_text(yaml.safe_dump(config))
            case = {"config": str(root / f"{slug}.yml"), "out": str(root / f"mk_{slug}"), "threshold": threshold}
            subprocess.run([args.mergekit_python, "-c", _MERGEKIT, json.dumps(case)], check=True)
            real = della.bernoulli_draws
            if threshold is not None:  # mergeflow draws through bernoulli_draws (same as torch.bernoulli)
                della.bernoulli_draws = lambda shape, keep, generator: keep > threshold  # noqa: B023
            try:
                merge_files(method, models, root / f"mf_{slug}", base=base, **options)
            finally:
                della.bernoulli_draws = real
            fraction, worst, largest = compare(root / f"mk_{slug}", root / f"mf_{slug}")
            print(f"| {name} | {fraction:.2e} | {worst:.2e} | {largest:.2f} |")

        from safetensors.torch import load_file

        density, epsilon = 0.5, 0.2
        files = [str(Path(p) / "model.safetensors") for p in (base, models[0])]
        out = str(root / "probabilities.safetensors")
        subprocess.run([args.mergekit_python, "-c", _PROBABILITIES, json.dumps([density, epsilon, *files, out])],
                       check=True)  # fmt: skip
        theirs, base_state, model_state = load_file(out), load_file(files[0]), load_file(files[1])
        worst, count = 0.0, 0
        for key, value in base_state.items():
            ours = keep_probabilities((model_state[key].double() - value.double()), density, epsilon)
            worst = max(worst, float((ours - theirs[key].double()).abs().max()))
            count += value.numel()
        print(f"\nkeep probabilities (density {density}, ε {epsilon}) of model 0's {len(base_state)} task vectors "
              f"({count} entries): largest difference from mergekit's {worst:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
