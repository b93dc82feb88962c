"""`mergeflow serve`: a scheduled deployment on a local Prefect server creates a run that executes the pipeline."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.request

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

        def two_completed_scheduled_runs() -> list[dict]:
            body = {"flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}}
            runs = _post(f"{prefect_api}/flow_runs/filter", body)
            root = str(path.resolve())
            ours = [run for run in runs if run.get("deployment_id") and run["parameters"]["root"] == root]
            return ours if len(ours) >= 2 else []  # the first does the work, the next finds it cached

        _wait(two_completed_scheduled_runs, time.monotonic() + 300, "two completed scheduled runs")
    finally:
        stop(serving)
        log.close()
    output = (tmp_path / "serve.log").read_text()
    # Each run's summary, as `mergeflow run` prints it: one that ran the pipeline, one with nothing to do.
    steps = len(json.loads((path / ".mergeflow/last_run.json").read_text())["steps"])
    summary = rf"^mergeflow: {steps} steps in [0-9.]+s: "
    assert re.search(summary + rf"{steps} ran, 0 cached\n  ran: prepare, ", output, re.M), output[-3000:]
    assert re.search(summary + rf"0 ran, {steps} cached$", output, re.M), output[-3000:]
    metrics = json.loads((path / "metrics/evaluate.json").read_text())
    assert 0 <= metrics["merged/average"]["accuracy"] <= 1
    record = json.loads((path / ".mergeflow/last_run.json").read_text())
    assert any(step["name"] == "merge/average" for step in record["steps"])


def test_sigterm_stops_serving_cleanly_with_a_run_in_flight(tmp_path, cli_env, prefect_api):
    # An SSF merge that would run for minutes: the stop cancels it rather than waiting for it.
    merge = {"methods": ["average", "ssf"], "options": {"ssf": {"steps": 100_000}}}
    path = make_workspace(tmp_path / "ws", fast_params(merge=merge, federated={"algorithms": []}))
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
        merging = "mergeflow: align:"  # the stage before the merge is done
        _wait(lambda: merging in (tmp_path / "serve.log").read_text(), time.monotonic() + 300, "the merge")
        time.sleep(2)
        serving.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = serving.wait(timeout=120)
        seconds = time.monotonic() - sent
    finally:
        stop(serving)
        log.close()
    output = (tmp_path / "serve.log").read_text()
    assert code == 0, output[-3000:]
    # Prefect's runner polls the run's process every 3 s and kills it after 30 s: well within that
    assert seconds < 25, output[-3000:]
    assert not list((path / ".mergeflow/results").glob("merge-ssf-*"))  # cancelled, not finished
    assert "Traceback" not in output and "never awaited" not in output, output[-3000:]
    assert output.rstrip().endswith("mergeflow: serve: stopped on SIGTERM; a run in flight, if any, was cancelled")
