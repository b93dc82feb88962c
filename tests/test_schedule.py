"""`mergeflow serve`: a scheduled deployment on a local Prefect server creates a run that executes the pipeline."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import BIN, fast_params, make_workspace, run_cli

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> list[dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _wait(predicate, deadline: float, what: str):
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(2)
    raise AssertionError(f"timed out waiting for {what}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


@pytest.fixture()
def prefect_server(tmp_path, cli_env):
    port = _free_port()
    env = {
        **cli_env,
        "PREFECT_HOME": str(tmp_path / "prefect-server"),
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(
        command, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    api = f"http://127.0.0.1:{port}/api"
    try:
        _wait(
            lambda: urllib.request.urlopen(f"{api}/health", timeout=5).status == 200, time.monotonic() + 120, "server"
        )
        yield api
    finally:
        _stop(server)


def test_serve_without_a_server_is_one_clear_error(tmp_path, cli_env):
    path = make_workspace(tmp_path / "ws", fast_params())
    env = {key: value for key, value in cli_env.items() if key != "PREFECT_API_URL"}
    done = run_cli(["serve", "--interval", "60"], path, env)
    assert done.returncode == 2
    assert "mergeflow: error: serve: schedules need a Prefect server" in done.stderr


def test_a_scheduled_run_executes_the_pipeline(tmp_path, cli_env, prefect_server):
    params = fast_params(merge={"methods": ["average"]}, federated={"algorithms": []})
    path = make_workspace(tmp_path / "ws", params)
    env = {**cli_env, "PREFECT_API_URL": prefect_server}
    log = (tmp_path / "serve.log").open("w")
    serving = subprocess.Popen(
        [str(BIN / "mergeflow"), "serve", "--interval", "5", "--name", "test-schedule"],
        cwd=path,
        env=env,
        start_new_session=True,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        def completed_scheduled_runs() -> list[dict]:
            body = {"flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}}
            runs = _post(f"{prefect_server}/flow_runs/filter", body)
            return [run for run in runs if run.get("deployment_id")]

        runs = _wait(completed_scheduled_runs, time.monotonic() + 300, "a completed scheduled run")
    finally:
        _stop(serving)
        log.close()
    assert runs[0]["parameters"]["root"] == str(Path(path).resolve())
    metrics = json.loads((path / "metrics/evaluate.json").read_text())
    assert 0 <= metrics["merged/average"]["accuracy"] <= 1
    record = json.loads((path / ".mergeflow/last_run.json").read_text())
    assert any(step["name"] == "merge/average" for step in record["steps"])
