"""Streaming merges of K Hugging Face GPT-2 checkpoints against a raw read of the files and a naive merge.

Usage: python bench/streaming_merge.py [--arch gpt2] [--models 4 8] [--n-layer 12] [--shard-size 200MB] [--dir DIR]
                                      [--keep] [--mergekit /tmp/mk-venv/bin/mergekit-yaml]
                                      [--cases model_stock slerp] [--repeat 1] [--threads 2]

Writes GPT-2 checkpoints with ``save_pretrained`` (``GPT2Config()``: 124M parameters, float32,
sharded at ``--shard-size``), or with ``--arch llama`` LLaMA-style ones (``LlamaConfig``, 768 wide, 12 heads,
an MLP of 3,072, a 32,000-token vocabulary and an untied head: 162M parameters, whose largest tensors are
the 32,000 × 768 embedding and head): a base model, K fine-tuned stand-ins (the base plus noise) and K
diagonal Fishers in the same format. For each K it then runs, each case in a fresh interpreter:

- a raw read of the K models' files (every byte, ``readinto`` a 64 MiB buffer): the I/O floor;
- a naive merge: ``load_file`` every shard of every model, ``torch.stack(...).mean(0)``, ``save_file``;
- ``merge_files`` for every tensor-scope method into an HF directory (``slerp`` on the first two
  models; methods that need a base get the base model, ``fisher`` the K Fisher directories), and
  DELLA with mergekit's ``rescale: l1``.

- mergekit (``--mergekit``, the ``mergekit-yaml`` of a separate venv; skipped when it is missing) with
  ``linear``, ``task_arithmetic`` and ``ties`` on the same files and the same settings as mergeflow's
  ``average``, ``task_arithmetic`` (λ 0.3) and ``ties`` (density 0.2, λ 1): whole-process seconds and
  the peak anonymous memory of the process less that of an interpreter that imports mergekit. Its
  outputs are compared with mergeflow's (elements that differ, largest difference).
  mergekit is no dependency of mergeflow; its venv is made once with:
      python3 -m venv /tmp/mk-venv
      /tmp/mk-venv/bin/pip install torch==2.13.0 mergekit==0.1.5

It prints one table per K: seconds after imports and as a ratio to the raw read, the CPU seconds of
the process after imports (all threads; steadier than seconds on a shared machine) and as a ratio to
the streamed average's, seconds of the whole process (interpreter start and imports included), and
the peak anonymous memory the case added (``RssAnon`` sampled every 5 ms less its value after
imports; page-cache pages of the files do not count) in MiB and as a ratio to one model's size.
Then the error of the streamed and the naive average against a float64 reference (the float64 mean
rounded once to float32). Files are read once before each K, so every case finds them in the page
cache.
``--cases`` runs only the cases whose name holds one of the given strings, beside the raw read (no
mergekit rows then); ``--repeat N`` runs each case N times and reports the least of each column.
Record the output in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

_PROLOGUE = """
import json, sys, threading, time
from pathlib import Path
import torch, safetensors.torch
from mergeflow.merge.streaming import merge_files
case = json.loads(sys.argv[1])
torch.set_num_threads(case["threads"])
models, base, fishers, out = case["models"], case["base"], case["fishers"], case["out"]


def rss_anon():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:"))


start_kib, peak = rss_anon(), [0]
done = threading.Event()


def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.005)


sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
started, cpu_started = time.perf_counter(), time.process_time()
"""
_EPILOGUE = """
seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
done.set()
sampler.join()
print(json.dumps({"seconds": seconds, "cpu": cpu, "anon_kib": max(peak[0], rss_anon()) - start_kib}))
"""
_RAW_READ = """
buffer = bytearray(1 << 26)
for directory in models:
    for path in sorted(Path(directory).glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
"""
_NAIVE = """
from safetensors.torch import load_file, save_file
states = []
for directory in models:
    states.append({})
    for path in sorted(Path(directory).glob("*.safetensors")):
        states[-1].update(load_file(path))
Path(out).mkdir(parents=True)
save_file({k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]}, f"{out}/model.safetensors")
"""
_ARGUMENTS = {
    "weighted": "weights=[1.0 + k for k in range(len(models))]",
    "task_arithmetic": "base=base, scaling=0.3",
    "fisher": "fishers=fishers, weights=[1.0] * len(models)",
    "ties": "base=base, density=0.2",
    "breadcrumbs": "base=base, density=0.2, gamma=0.01",
    "breadcrumbs_ties": "base=base, density=0.2, gamma=0.01",
    "della": "base=base, density=0.5, epsilon=0.1",
    "della_linear": "base=base, density=0.5, epsilon=0.1",
    "dare_linear": "base=base, drop_rate=0.9",
    "dare_ties": "base=base, drop_rate=0.9",
    "model_stock": "base=base",
    "slerp": "t=0.5",
}


def cases() -> dict[str, str]:
    """Case name -> code run between the prologue and the epilogue."""
    from mergeflow.merge import METHODS

    methods = sorted(name for name, declaration in METHODS.items() if declaration.scope == "tensor")
    streaming = {
        f"merge_files({name!r})": f"merge_files({name!r}, models{'[:2]' if name == 'slerp' else ''}, out, "
        f"max_shard_size=case['shard_size'], {_ARGUMENTS.get(name, '')})"
        for name in methods
    }
    l1 = f"merge_files('della', models, out, max_shard_size=case['shard_size'], {_ARGUMENTS['della']}, rescale='l1')"
    streaming["merge_files('della', rescale='l1')"] = l1
    return {"raw read": _RAW_READ, "naive: load, stack, mean, save": _NAIVE, **streaming, "import only": ""}


# mergekit's method and its settings for each mergeflow case it is compared with (same semantics).
MERGEKIT = {
    "linear": ("merge_files('average')", {"weight": 1.0}, {"normalize": True}),
    "task_arithmetic": ("merge_files('task_arithmetic')", {"weight": 0.3}, {"normalize": False}),
    "ties": ("merge_files('ties')", {"weight": 1.0, "density": 0.2}, {"normalize": True, "lambda": 1.0}),
}


def mergekit_config(method: str, models: list[str], base: str) -> dict:
    """A mergekit-yaml config: ``method`` over ``models`` (and ``base``), float32."""
    _, per_model, overall = MERGEKIT[method]
    config = {
        "merge_method": method,
        "models": [{"model": m, "parameters": per_model} for m in models],
        "parameters": overall,
        "dtype": "float32",
    }
    if method != "linear":
        config["base_model"] = base
    return config


def rss_anon_peak(command: list[str]) -> tuple[float, float]:
    """Seconds of a process and its peak anonymous memory (KiB), sampled every 5 ms from outside."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    while process.poll() is None:
        try:
            with open(f"/proc/{process.pid}/status") as status:
                peak = max(peak, next(int(line.split()[1]) for line in status if line.startswith("RssAnon:")))
        except (OSError, StopIteration):
            pass
        time.sleep(0.005)
    seconds = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(process.stderr.read())
    return seconds, peak


def run_mergekit(mergekit: Path, method: str, case: dict, shard_size: str) -> dict[str, float]:
    """One mergekit-yaml process on the case's files: its seconds and peak anonymous memory (KiB, whole process)."""
    import yaml

    out = Path(case["out"])
    config = out.with_suffix(".yml")
    config.write_text(yaml.safe_dump(mergekit_config(method, case["models"], case["base"])))
    from huggingface_hub.serialization._base import parse_size_to_int

    # mergekit counts a shard in parameters: the same bytes of float32
    command = [str(mergekit), str(config), str(out), "--out-shard-size", str(parse_size_to_int(shard_size) // 4)]
    command.append("--no-copy-tokenizer")
    seconds, peak = rss_anon_peak(command)
    return {"seconds": seconds, "process": seconds, "anon_kib": peak}


def base_model(arch: str, n_layer: int) -> torch.nn.Module:
    """The random base model: GPT-2 (124M at 12 layers) or LLaMA-style (162M at 12 layers)."""
    import transformers

    if arch == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=n_layer))
    config = transformers.LlamaConfig(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=n_layer,
        num_attention_heads=12,
        num_key_value_heads=12,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def write_checkpoints(
    directory: Path, count: int, arch: str, n_layer: int, shard_size: str
) -> tuple[list[str], str, list[str]]:
    """A base model, ``count`` noisy copies and ``count`` Fishers as HF directories (kept between runs)."""
    from huggingface_hub import save_torch_state_dict

    base, models, fishers = directory / "base", [], []
    paths = [directory / f"model_{k}" for k in range(count)] + [directory / f"fisher_{k}" for k in range(count)]
    if base.exists() and all(p.exists() for p in paths):
        return [str(p) for p in paths[:count]], str(base), [str(p) for p in paths[count:]]
    torch.manual_seed(0)
    model = base_model(arch, n_layer)
    model.save_pretrained(base, max_shard_size=shard_size)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for k in range(count):
        generator = torch.Generator().manual_seed(k + 1)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                parameter.copy_(state[name] + 0.01 * torch.randn(parameter.shape, generator=generator))
        model.save_pretrained(directory / f"model_{k}", max_shard_size=shard_size)
        fisher = {
            name: torch.rand(parameter.shape, generator=generator) for name, parameter in model.named_parameters()
        }
        (directory / f"fisher_{k}").mkdir(exist_ok=True)
        save_torch_state_dict(fisher, directory / f"fisher_{k}", max_shard_size=shard_size)
        models.append(str(directory / f"model_{k}"))
        fishers.append(str(directory / f"fisher_{k}"))
    return models, str(base), fishers


def run_case(code: str, case: dict) -> dict[str, float]:
    """Run one case in a fresh interpreter; its times and the peak anonymous memory it added."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _PROLOGUE + code + _EPILOGUE, json.dumps(case)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process"] = time.perf_counter() - started
    return result


def agreement(first: Path, second: Path) -> tuple[float, int, float]:
    """Between two merged models: the fraction of elements that differ at all, the number that differ by
    more than 1e-6 (more than rounding), and the largest absolute difference."""
    from mergeflow.hf_checkpoints import open_checkpoint

    a, b = open_checkpoint(first), open_checkpoint(second)
    differ = total = beyond = 0
    worst = 0.0
    for key in a:
        gap = (a[key].double() - b[key].double()).abs()
        differ += int((gap > 0).sum())
        beyond += int((gap > 1e-6).sum())
        total += gap.numel()
        worst = max(worst, float(gap.max()))
    a.close()
    b.close()
    return differ / total, beyond, worst


def accuracy(models: list[str], outputs: dict[str, Path]) -> dict[str, tuple[float, float]]:
    """Per output: the fraction of elements that differ from the float64 mean rounded once to float32, and the
    largest difference in units in the last place of the largest input at that element (the scale a float32
    sum works at; the result's own ulp is tiny where the inputs cancel)."""
    from mergeflow.hf_checkpoints import open_checkpoint

    checkpoints = [open_checkpoint(m) for m in models]
    results = {}
    for name, out in outputs.items():
        merged = open_checkpoint(out)
        differ = total = 0
        worst = 0.0
        for key in merged:
            inputs = torch.stack([c[key].double() for c in checkpoints])
            reference = inputs.mean(0).float()
            scale = inputs.abs().amax(0).float()
            ulp = (torch.nextafter(scale, torch.tensor(float("inf"))) - scale).double()
            gap = (merged[key].double() - reference.double()).abs()
            differ += int((gap > 0).sum())
            total += gap.numel()
            worst = max(worst, float((gap / ulp).max()))
        merged.close()
        results[name] = (differ / total, worst)
    for checkpoint in checkpoints:
        checkpoint.close()
    return results


def warm(paths: list[str]) -> None:
    """Read every file once, so that every case finds them in the page cache."""
    buffer = bytearray(1 << 26)
    for directory in paths:
        for path in Path(directory).glob("*.safetensors"):
            with path.open("rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--models", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--shard-size", default="200MB")
    parser.add_argument("--dir", help="where the checkpoints go (default /tmp/mergeflow-stream-ARCH)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints for another run")
    parser.add_argument("--mergekit", type=Path, default=Path("/tmp/mk-venv/bin/mergekit-yaml"))
    parser.add_argument("--cases", nargs="+", help="only the cases whose name holds one of these (and the raw read)")
    parser.add_argument("--repeat", type=int, default=1, help="run each case this many times; report the least")
    parser.add_argument("--threads", type=int, default=2, help="torch's intra-op threads in each case")
    args = parser.parse_args()
    mergekit = args.mergekit if args.mergekit.is_file() and not args.cases else None
    if mergekit is None:
        print(f"{args.mergekit} not found: no mergekit rows (see this script's docstring)")
    else:
        interpreter = str(mergekit.parent / "python")
        _, mergekit_import_kib = rss_anon_peak([interpreter, "-c", "import mergekit.merge, mergekit.config"])
    directory = Path(args.dir or f"/tmp/mergeflow-stream-{args.arch}")
    models, base, fishers = write_checkpoints(directory, max(args.models), args.arch, args.n_layer, args.shard_size)
    model_bytes = sum(p.stat().st_size for p in Path(models[0]).glob("*.safetensors"))
    name = {"gpt2": "GPT-2", "llama": "LLaMA-style"}[args.arch]
    size = f"{model_bytes / 2**20:.0f} MiB per model"
    print(f"{name} (n_layer={args.n_layer}), float32, {size}, shards of {args.shard_size}")
    for count in args.models:
        warm([*models[:count], base, *fishers[:count]])
        results, outputs = {}, {}
        chosen = {
            name: code
            for name, code in cases().items()
            if not args.cases or name in ("import only", "raw read") or any(part in name for part in args.cases)
        }
        for name, code in chosen.items():
            out = directory / "out" / name.replace(" ", "_").replace("'", "").replace("(", "").replace(")", "")
            shutil.rmtree(out, ignore_errors=True)
            case = {
                "models": models[:count],
                "base": base,
                "fishers": fishers[:count],
                "out": str(out),
                "shard_size": args.shard_size,
                "threads": args.threads,
            }
            runs = []
            for _ in range(args.repeat):
                shutil.rmtree(out, ignore_errors=True)
                runs.append(run_case(code, case))
            results[name] = {key: min(run[key] for run in runs) for key in runs[0]}
            if name in ("naive: load, stack, mean, save", *(compared for compared, _, _ in MERGEKIT.values())):
                outputs[name] = out
            elif out.exists():
                shutil.rmtree(out)
        for method in MERGEKIT if mergekit is not None else ():
            out = directory / "out" / f"mergekit_{method}"
            shutil.rmtree(out, ignore_errors=True)
            name = f"mergekit {method}"
            results[name] = run_mergekit(mergekit, method, {**case, "out": str(out)}, args.shard_size)
            results[name]["anon_kib"] -= mergekit_import_kib
            outputs[name] = out
        start = results.pop("import only")
        raw = results["raw read"]["seconds"]
        print(
            f"\nK = {count}, torch threads {args.threads}; "
            f"an interpreter that imports torch and mergeflow: {start['process']:.2f} s"
        )
        average = results.get("merge_files('average')", {})
        print(
            "| case | seconds | ÷ raw read | CPU seconds | CPU ÷ average's | process seconds "
            "| peak anonymous memory (MiB) | ÷ one model |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, r in results.items():
            extra = r["anon_kib"] * 1024
            cpu = f"{r['cpu']:.2f}" if "cpu" in r else ""
            ratio = f"{r['cpu'] / average['cpu']:.2f}" if "cpu" in r and "cpu" in average else ""
            print(
                f"| {name} | {r['seconds']:.2f} | {r['seconds'] / raw:.2f} | {cpu} | {ratio} | {r['process']:.2f} | "
                f"{extra / 2**20:.0f} | {extra / model_bytes:.2f} |"
            )
        print("\n| average | elements ≠ float64 reference | largest difference (ulp of the largest input) |")
        print("|---|---:|---:|")
        names = ("merge_files('average')", "naive: load, stack, mean, save", "mergekit linear")
        averages = {name: outputs[name] for name in names if name in outputs}
        for name, (fraction, worst) in accuracy(models[:count], averages).items():
            print(f"| {name} | {fraction:.2e} | {worst:.2f} |")
        if mergekit is not None:
            print("\n| mergekit against mergeflow | elements that differ | > 1e-6 apart | largest difference |")
            print("|---|---:|---:|---:|")
            for method, (compared, _, _) in MERGEKIT.items():
                fraction, beyond, worst = agreement(outputs[f"mergekit {method}"], outputs[compared])
                print(f"| {method} / {compared} | {fraction:.2e} | {beyond} | {worst:.2e} |")
        shutil.rmtree(directory / "out")
    if not args.keep:
        shutil.rmtree(directory)


if __name__ == "__main__":
    main()
