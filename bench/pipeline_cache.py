"""Wall time of a cold pipeline run, a fully cached re-run and a re-run after one merge option.

Usage: python bench/pipeline_cache.py [--params params.yaml]

All three runs happen side by side in one fresh workspace with a fresh Prefect home and
artifact store, each as a separate `mergeflow run` process (what a user types). The
ratios to the cold run are printed; record them in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def timed_run(workspace: Path, env: dict[str, str], *overrides: str) -> float:
    """Seconds for one `mergeflow run` process."""
    command = [str(BIN / "mergeflow"), "run", *(arg for o in overrides for arg in ("-S", o))]
    started = time.perf_counter()
    subprocess.run(command, cwd=workspace, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    """Run the three cases and print times and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=str(Path(__file__).resolve().parent.parent / "params.yaml"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workspace = Path(tmp) / "workspace"
        workspace.mkdir()
        shutil.copy(args.params, workspace / "params.yaml")
        env = {**os.environ, "PREFECT_HOME": str(Path(tmp) / "prefect"), "HF_DATASETS_OFFLINE": "1"}
        env.pop("MLFLOW_TRACKING_URI", None)
        # A throwaway flow first, so the cold run does not also pay Prefect's one-time DB migration.
        warm_up = "from prefect import flow; flow(name='warm-up')(lambda: None)()"
        subprocess.run([sys.executable, "-c", warm_up], env=env, check=True, capture_output=True)
        cold = timed_run(workspace, env)
        cached = timed_run(workspace, env)
        changed = timed_run(workspace, env, "merge.options.task_arithmetic.scaling=0.5")
    print(f"{'case':<28}{'seconds':>9}{'ratio to cold':>15}")
    for name, seconds in (("cold run", cold), ("fully cached re-run", cached), ("one merge option changed", changed)):
        print(f"{name:<28}{seconds:>9.1f}{seconds / cold:>15.2f}")


if __name__ == "__main__":
    main()
