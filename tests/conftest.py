"""Shared fixtures: an isolated Prefect home, small fast params, and a CLI runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# Small enough to run the whole pipeline in seconds, large enough to be a real run.
FAST_OVERRIDES = {
    "partition": {"num_clients": 3, "alpha": 1.0},
    "pretrain": {"epochs": 3},
    "finetune": {"epochs": 2},
    "federated": {"rounds": 2},
    "orchestration": {"max_workers": 2},
}


def fast_params(**sections: dict) -> dict:
    """The committed params.yaml with the fast settings and any extra section changes merged in."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for name, changes in {**FAST_OVERRIDES, **sections}.items():
        if isinstance(changes, dict):
            params.setdefault(name, {}).update(changes)
        else:
            params[name] = changes
    return params


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory) -> dict[str, str]:
    """Environment for CLI subprocesses: offline, a private Prefect home, the venv's tools on PATH."""
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(
        PREFECT_HOME=str(tmp_path_factory.mktemp("prefect-home")),
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_cli(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``mergeflow ARGS`` in ``cwd`` and return the finished process (text output)."""
    return subprocess.run(
        [str(BIN / "mergeflow"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def ran_steps(workspace: Path) -> set[str]:
    """Names of the steps the last run executed (not served from the cache)."""
    record = json.loads((workspace / ".mergeflow" / "last_run.json").read_text())
    return {step["name"] for step in record["steps"] if not step["cached"]}


def make_workspace(path: Path, params: dict) -> Path:
    """A directory holding only a params.yaml."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return path
