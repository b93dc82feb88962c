"""`mergeflow serve`: a scheduled deployment on a local Prefect server creates a run that executes the pipeline."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import BIN, fast_params, make_workspace, run_cli, stop

pytestmark = pytest.mark.slow


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


def test_serve_without_a_server_is_one_clear_error(tmp_path, cli_env):
    path = make_workspace(tmp_path / "ws", fast_params())
    env = {key: value for key, value in cli_env.items() if key != "PREFECT_API_URL"}
    done = run_cli(["serve", "--interval", "60"], path, env)
    assert done.returncode == 2
    assert "mergeflow: error: serve: schedules need a Prefect server" in done.stderr


def test_a_scheduled_run_executes_the_pipeline(tmp_path, cli_env, prefect_api):
    params = fast_params(merge={"methods": ["average"]}, federated={"algorithms": []})
    path = make_workspace(tmp_path / "ws", params)
    env = cli_env  # it points at the session's Prefect server
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
            runs = _post(f"{prefect_api}/flow_runs/filter", body)
            return [run for run in runs if run.get("deployment_id")]

        runs = _wait(completed_scheduled_runs, time.monotonic() + 300, "a completed scheduled run")
    finally:
        stop(serving)
        log.close()
    assert runs[0]["parameters"]["root"] == str(Path(path).resolve())
    metrics = json.loads((path / "metrics/evaluate.json").read_text())
    assert 0 <= metrics["merged/average"]["accuracy"] <= 1
    record = json.loads((path / ".mergeflow/last_run.json").read_text())
    assert any(step["name"] == "merge/average" for step in record["steps"])


def test_sigterm_stops_serving_cleanly_with_a_run_in_flight(tmp_path, cli_env, prefect_api):
    path = make_workspace(tmp_path / "ws", fast_params(federated={"algorithms": []}))
    log = (tmp_path / "serve.log").open("w")
    serving = subprocess.Popen(
        [str(BIN / "mergeflow"), "serve", "--interval", "5", "--name", "test-sigterm"],
        cwd=path,
        env=cli_env,
        start_new_session=True,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:

        def running_scheduled_run() -> list[dict]:
            body = {"flow_runs": {"state": {"type": {"any_": ["RUNNING"]}}}}
            return [run for run in _post(f"{prefect_api}/flow_runs/filter", body) if run.get("deployment_id")]

        _wait(running_scheduled_run, time.monotonic() + 300, "a scheduled run in flight")
        time.sleep(3)  # into the pipeline's steps
        serving.send_signal(signal.SIGTERM)
        code = serving.wait(timeout=120)
    finally:
        stop(serving)
        log.close()
    output = (tmp_path / "serve.log").read_text()
    assert code == 0, output[-3000:]
    assert "Traceback" not in output and "never awaited" not in output, output[-3000:]
    assert output.rstrip().endswith("mergeflow: serve: stopped on SIGTERM; a run in flight, if any, was cancelled")
