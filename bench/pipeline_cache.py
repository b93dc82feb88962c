"""Wall time of a cold pipeline run, a fully cached re-run and a re-run after one merge option.

Usage: python bench/pipeline_cache.py [--params params.yaml] [--no-dvc]

Two groups, each in a fresh workspace with a fresh Prefect home and artifact store:

- ``mergeflow run``: separate processes (what a user types): ``mergeflow validate``, cold,
  unchanged (with its per-step lookup cost, from ``.mergeflow/last_run.json``), and after
  ``merge.options.task_arithmetic.scaling=0.5``;
- ``dvc repro`` in a git copy of the project (``git ls-files``): the same three cases, where
  every DVC stage is its own ``mergeflow stage`` process.

Before each group a throw-away flow migrates Prefect's database, so the cold run does not
pay that one-time cost. The ratios to each group's cold run are printed, then the two no-op runs
side by side; record them in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent
CHANGE = ("merge", "options", "task_arithmetic", "scaling")


def timed(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    """Seconds and stdout of one process, which must succeed."""
    started = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return time.perf_counter() - started, done.stdout


def fresh_env(home: Path) -> dict[str, str]:
    """Offline, a private Prefect home whose database is already migrated, the venv on PATH."""
    env = {**os.environ, "PREFECT_HOME": str(home), "HF_DATASETS_OFFLINE": "1"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("PREFECT_API_URL", None)
    warm_up = "from prefect import flow; flow(name='warm-up')(lambda: None)()"
    subprocess.run([sys.executable, "-c", warm_up], env=env, check=True, capture_output=True)
    return env


def changed_params(path: Path) -> None:
    """Set the one merge option the third case changes."""
    params = yaml.safe_load(path.read_text())
    *parents, leaf = CHANGE
    section = params
    for key in parents:
        section = section.setdefault(key, {})
    section[leaf] = 0.5
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def mergeflow_cases(params: Path, tmp: Path) -> list[tuple[str, float]]:
    """Cold, cached and one-option-changed ``mergeflow run`` processes."""
    workspace = tmp / "workspace"
    workspace.mkdir()
    shutil.copy(params, workspace / "params.yaml")
    env = fresh_env(tmp / "prefect-run")
    run = [str(BIN / "mergeflow"), "run"]
    validate, _ = timed([str(BIN / "mergeflow"), "validate"], workspace, env)
    cold, _ = timed(run, workspace, env)
    cached, _ = timed(run, workspace, env)
    record = json.loads((workspace / ".mergeflow" / "last_run.json").read_text())
    lookup = record["seconds"] / len(record["steps"]) * 1000
    changed, _ = timed([*run, "-S", f"{'.'.join(CHANGE)}=0.5"], workspace, env)
    return [
        ("cold run", cold),
        ("`mergeflow validate`", validate),
        (f"fully cached re-run ({len(record['steps'])} steps looked up, {lookup:.2f} ms each)", cached),
        ("one merge option changed", changed),
    ]


def dvc_cases(params: Path, tmp: Path) -> list[tuple[str, float]]:
    """Cold, unchanged and one-option-changed ``dvc repro`` in a git copy of the project."""
    project = tmp / "project"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (project / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, project / name)
    shutil.copy(params, project / "params.yaml")
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    env = fresh_env(tmp / "prefect-dvc")
    repro = [str(BIN / "dvc"), "repro"]
    cold, _ = timed(repro, project, env)
    unchanged, out = timed(repro, project, env)
    if "Running stage" in out:
        raise SystemExit("the second `dvc repro` ran a stage")
    changed_params(project / "params.yaml")
    changed, out = timed(repro, project, env)
    stages = sum(line.startswith("Running stage") for line in out.splitlines())
    return [
        ("first `dvc repro`", cold),
        ("`dvc repro`, nothing changed", unchanged),
        (f"`dvc repro`, one merge option changed ({stages} stages)", changed),
    ]


def main() -> None:
    """Run both groups and print times and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--no-dvc", action="store_true", help="skip the `dvc repro` group")
    args = parser.parse_args()
    groups = []
    with tempfile.TemporaryDirectory() as tmp:
        groups.append(mergeflow_cases(args.params.resolve(), Path(tmp)))
        if not args.no_dvc:
            groups.append(dvc_cases(args.params.resolve(), Path(tmp)))
    print("| case | seconds | ratio to cold |\n|---|---:|---:|")
    for cases in groups:
        cold = cases[0][1]
        for name, seconds in cases:
            print(f"| {name} | {seconds:.2f} | {seconds / cold:.3f} |")
    if len(groups) == 2:  # the no-op runs side by side: mergeflow's fully cached run against DVC's
        mergeflow_noop, dvc_noop = groups[0][2][1], groups[1][1][1]
        print(
            f"\nno-op: `mergeflow run` {mergeflow_noop:.2f} s, `dvc repro` {dvc_noop:.2f} s, "
            f"ratio {mergeflow_noop / dvc_noop:.2f}"
        )


if __name__ == "__main__":
    main()
