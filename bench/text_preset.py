"""Wall time and peak memory of the transformers text preset, cold and re-run.

Usage: python bench/text_preset.py [--params experiments/text.yaml] [--dir DIR]

In a fresh workspace (its own Prefect home, artifact store and MLflow database), runs as a user
would, each a separate ``mergeflow run`` process:

- cold: the preset from nothing (WordNet read, tokenizer trained, base pre-trained, clients
  fine-tuned, every merge and search, FedAvg, evaluation, MLflow);
- LoRA: the same preset with ``finetune.lora={r: 8, alpha: 16}`` and ``finetune.lr=0.002``, which
  re-uses the cached data, tokenizer and base model;
- unchanged: the cold run's params again (every step cached).

For each: seconds, and the peak resident memory of the whole process tree (``mergeflow run`` and
every process it starts, summed, sampled every 0.2 s) and of its largest process. Each case's
``metrics/evaluate.json`` is kept as ``evaluate-<case>.json`` in the workspace. Needs a WordNet
database (Debian's wordnet-base). Record the output in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent
LORA = ["-S", "finetune.lora={r: 8, alpha: 16}", "-S", "finetune.lr=0.002"]


def measured(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, float, str]:
    """Seconds, peak summed RSS of the process tree (GiB), peak RSS of one process (GiB), and the step summary."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks = [0, 0]
    done = threading.Event()

    def sample() -> None:
        root = psutil.Process(process.pid)
        while not done.is_set():
            try:
                sizes = [p.memory_info().rss for p in [root, *root.children(recursive=True)]]
            except psutil.Error:
                sizes = []
            if sizes:
                peaks[0], peaks[1] = max(peaks[0], sum(sizes)), max(peaks[1], max(sizes))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = process.communicate()
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    if process.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{output[-3000:]}")
    summary = [line for line in output.splitlines() if line.startswith("mergeflow: ") and " steps in " in line]
    return seconds, peaks[0] / 2**30, peaks[1] / 2**30, (summary or ["(no summary line)"])[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=str(ROOT / "experiments/text.yaml"))
    parser.add_argument("--dir", default=None, help="workspace (default: a new temp directory, removed after)")
    args = parser.parse_args()
    workspace = Path(args.dir or tempfile.mkdtemp(prefix="mergeflow-text-"))
    workspace.mkdir(parents=True, exist_ok=True)
    shutil.copy(args.params, workspace / "params.yaml")
    env = dict(os.environ, PREFECT_HOME=str(workspace / ".prefect-home"), HF_HUB_OFFLINE="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("PREFECT_API_URL", None)
    run = [str(BIN / "mergeflow"), "run"]
    print(f"{Path(args.params).name}: workspace {workspace}, {os.cpu_count()} cores")
    print(f"{'case':10s} {'seconds':>8s} {'tree GiB':>9s} {'max proc GiB':>13s}  summary")
    for case, command in (("cold", run), ("LoRA", run + LORA), ("unchanged", run)):
        seconds, tree, largest, last = measured(command, workspace, env)
        print(f"{case:10s} {seconds:8.1f} {tree:9.2f} {largest:13.2f}  {last[:90]}")
        shutil.copy(workspace / "metrics/evaluate.json", workspace / f"evaluate-{case}.json")
    if args.dir is None:
        shutil.rmtree(workspace)


if __name__ == "__main__":
    main()
