"""Shared fixtures: an isolated Prefect home, small fast params, and a CLI runner.

The tests' params are built here from the schema's defaults, never read from the workspace's
``params.yaml``: a user's edit of that file must not change what a test runs or expects.
"""

from __future__ import annotations

import copy
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
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from mergeflow.config import Params

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# The pipeline the tests run, over the schema's defaults: every kind of merge (data-free, Fisher, exact
# with low-rank factors, SSF) and every federated family. The committed params.yaml's choices, copied so
# that an edit of a workspace's params.yaml cannot change a test.
PIPELINE = {
    "fisher": {"low_rank": True, "rank_examples": 16},
    "merge": {
        "methods": ["average", "weighted", "task_arithmetic", "fisher", "exact", "ssf"],
        "options": {
            "task_arithmetic": {"scaling": 0.3},
            "fisher": {"by_size": True, "normalize": False},
            "exact": {"prior_precision": 0.1},
            "ssf": {
                "mask_rate": 0.3,
                "masks_per_step": 10,
                "steps": 300,
                "window": 1000,
                "optimizer": "adam",
                "lr": 0.003,
            },
        },
    },
    "federated": {
        "algorithms": ["fedavg", "fedprox", "fedadmm", "bayes_admm"],
        "options": {
            "fedprox": {"mu": 0.01},
            "fedadmm": {"rho": 10.0},
            "bayes_admm": {
                "rho": 1.0,
                "damping": 0.1,
                "temperature": 0.001,
                "prior_precision": 1.0,
                "lr": 0.01,
                "hess_init": 0.01,
                "beta2": 0.999,
            },
        },
    },
    "finetune": {"epochs": 10},
    "partition": {"num_clients": 5},
    "orchestration": {"max_workers": 2},
}

# Small enough to run the whole pipeline in seconds, large enough to be a real run.
FAST_OVERRIDES = {
    "partition": {"num_clients": 3, "alpha": 1.0},
    "pretrain": {"epochs": 3},
    "finetune": {"epochs": 2},
    "federated": {"rounds": 2},
    "orchestration": {"max_workers": 2},
}


def schema_defaults(model: type[BaseModel] = Params) -> dict[str, Any]:
    """Every key of ``model`` at the default its schema declares, as a params file spells it.

    A section is walked through its class, so values that validation derives (the align sizes of the model
    family, a transformer's default config) stay unset, as in a params file that leaves them out.
    """
    raw = {}
    for name, field in model.model_fields.items():
        value = field.get_default(call_default_factory=True)
        raw[name] = schema_defaults(type(value)) if isinstance(value, BaseModel) else copy.deepcopy(value)
    return raw


def _merged(params: dict, sections: dict) -> dict:
    """``params`` with each section's keys changed (a non-mapping replaces the section)."""
    for name, changes in copy.deepcopy(sections).items():
        if isinstance(changes, dict):
            params.setdefault(name, {}).update(changes)
        else:
            params[name] = changes
    return params


def pipeline_params() -> dict:
    """The tests' full-size pipeline (:data:`PIPELINE` over the schema's defaults), as a raw params mapping."""
    return _merged(schema_defaults(), PIPELINE)


def fast_params(**sections: dict) -> dict:
    """The tests' pipeline with the fast settings, and any extra section changes instead of a section's."""
    return _merged(pipeline_params(), {**FAST_OVERRIDES, **sections})


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


def browser_page(workspace: Path, port: int, env: dict[str, str], showing: str = "Run Name") -> str:
    """The DOM of the experiment's runs page (``mergeflow ui --print-url``) as a headless Chromium renders it,
    from an MLflow UI serving ``workspace``'s store on ``port``: rendered again (at most 4 times) until it
    holds ``showing``, since a loaded machine may dump it before the runs arrive."""
    url = run_cli(["ui", "--print-url", "--port", str(port)], workspace, env).stdout.strip()
    store = f"sqlite:///{workspace / 'mlflow.db'}"
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store, "--port", str(port)]
    server = subprocess.Popen(
        [*command, "--host", "127.0.0.1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(f"http://127.0.0.1:{port}/health", server)
        browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000"]
        for _ in range(4):
            page = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
            if showing in page:
                break
        return page
    finally:
        stop(server)


def start_prefect_server(home: Path) -> tuple[subprocess.Popen, str]:
    """A ``prefect server start`` on a free loopback port, in its own process group (:func:`stop` it), with its
    home in ``home`` (the scheduler loops every 2 s); once it answers, the process and its API's URL."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
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
    except BaseException:
        stop(server)
        raise
    return server, f"http://127.0.0.1:{port}/api"


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory) -> Iterator[str]:
    """One local Prefect server for the session.

    Every CLI run would otherwise start its own ephemeral API server, 5 to 10 s each.
    """
    server, api = start_prefect_server(tmp_path_factory.mktemp("prefect-server"))
    try:
        yield api
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


@pytest.fixture(scope="module")
def dvc_env(cli_env, tmp_path_factory) -> dict[str, str]:
    """The CLI environment, with DVC's global and system config (and its site cache) in empty directories."""
    home = tmp_path_factory.mktemp("dvc-home")
    dirs = {name: home / name for name in ("global", "system", "site")}
    for path in dirs.values():
        path.mkdir()
    return cli_env | {
        "DVC_GLOBAL_CONFIG_DIR": str(dirs["global"]),
        "DVC_SYSTEM_CONFIG_DIR": str(dirs["system"]),
        "DVC_SITE_CACHE_DIR": str(dirs["site"]),
        "DVC_NO_ANALYTICS": "1",
    }
