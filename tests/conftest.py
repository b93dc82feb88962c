"""Shared fixtures: an isolated Prefect home, small fast params, and a CLI runner."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, process: subprocess.Popen, timeout: float = 120) -> None:
    """Poll ``url`` until it answers 200, failing if ``process`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if urllib.request.urlopen(url, timeout=5).status == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline and process.poll() is None, f"{url} did not come up"
        time.sleep(1)


def stop(process: subprocess.Popen) -> None:
    """Kill a process started with ``start_new_session=True`` and all its children."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory) -> Iterator[str]:
    """One local Prefect server for the session (the scheduler loops every 2 s).

    Every CLI run would otherwise start its own ephemeral API server, 5 to 10 s each.
    """
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-server")),
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    port = free_port()
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(
        command, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    try:
        wait_for(f"http://127.0.0.1:{port}/api/health", server)
        yield f"http://127.0.0.1:{port}/api"
    finally:
        stop(server)


@pytest.fixture
def prefect_settings(prefect_api, tmp_path):
    """In-process flows against the session's Prefect server, with a private Prefect home."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

    # No log shipping: its background worker would still be sending after the session's server stops.
    updates = {
        PREFECT_API_URL: prefect_api,
        PREFECT_HOME: str(tmp_path / "prefect"),
        PREFECT_LOGGING_TO_API_ENABLED: False,
    }
    with temporary_settings(updates=updates):
        yield


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory, prefect_api) -> dict[str, str]:
    """Environment for CLI subprocesses: offline, a private Prefect home and the session's Prefect
    server, the venv's tools on PATH."""
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(
        PREFECT_HOME=str(tmp_path_factory.mktemp("prefect-home")),
        PREFECT_API_URL=prefect_api,
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
