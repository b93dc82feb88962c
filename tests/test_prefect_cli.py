"""The Prefect CLI that users inspect scheduled runs with works against a `prefect server start`.

fastapi>=0.151 with prefect 3.8 rejects the CLI's `"limit": null` with a 422 (constraints.txt).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from conftest import BIN

pytestmark = pytest.mark.slow

FLOW, DEPLOYMENT, RUN = "cli-check-flow", "cli-check-deployment", "cli-check-run"


_RETRIED = (429, 502, 503)  # what Prefect's own client retries: a busy server (its SQLite locked) answers 503


def _post(url: str, body: dict) -> dict:
    """POST ``body`` as JSON and return the decoded answer, retrying a busy server's answer as Prefect's client
    does (1, 2, 4 and 8 s apart)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    for delay in (1, 2, 4, 8):
        try:
            return _answer(request)
        except urllib.error.HTTPError as error:
            if error.code not in _RETRIED:
                raise
        time.sleep(delay)
    return _answer(request)


def _answer(request: urllib.request.Request) -> dict:
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def listed(prefect_api: str) -> str:
    """The session's server with a flow, a deployment of it and a scheduled run of it to list."""
    flow_id = _post(f"{prefect_api}/flows/", {"name": FLOW})["id"]
    deployment_id = _post(f"{prefect_api}/deployments/", {"name": DEPLOYMENT, "flow_id": flow_id})["id"]
    run = {"flow_id": flow_id, "deployment_id": deployment_id, "name": RUN, "state": {"type": "SCHEDULED"}}
    _post(f"{prefect_api}/flow_runs/", run)
    return prefect_api


# Other tests' schedules fill the 15 newest runs of the shared server: the run is looked up by its flow.
COMMANDS = [(["flow-run", "ls", "--flow-name", FLOW], RUN), (["deployment", "ls"], DEPLOYMENT)]


@pytest.mark.parametrize(("command", "name"), COMMANDS, ids=["flow-run ls", "deployment ls"])
def test_the_prefect_cli_lists_what_the_server_holds(listed, tmp_path, command, name):
    # Wide columns, so the table does not cut the name it is checked for.
    env = {**os.environ, "PREFECT_API_URL": listed, "PREFECT_HOME": str(tmp_path), "COLUMNS": "250"}
    done = subprocess.run([str(BIN / "prefect"), *command], env=env, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Traceback" not in output
    assert name in output, output
