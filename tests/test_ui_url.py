"""`mergeflow ui --print-url` gives the experiment's runs page, not MLflow 3's GenAI overview."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import run_cli


def test_the_ui_url_opens_the_experiments_runs(tmp_path):
    from mlflow.tracking import MlflowClient

    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    (tmp_path / "params.yaml").write_text("tracking: {experiment: merges}\n")
    done = run_cli(["ui", "--print-url", "--port", "5001"], tmp_path, env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "http://127.0.0.1:5001/#/experiments"  # nothing logged yet

    experiment = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").create_experiment("merges")
    done = run_cli(["ui", "--print-url", "--port", "5001"], tmp_path, env)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = f"http://127.0.0.1:5001/#/experiments/{experiment}/runs?workflowType=machine_learning"
    assert done.stdout.strip() == expected


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs a headless Chromium (Debian's chromium package)")
def test_a_browser_opening_the_ui_url_sees_the_runs_table(tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("mergeflow")
    client.create_run(experiment, run_name="pipeline-run-to-find")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    port = 5000 + os.getpid() % 1000
    url = run_cli(["ui", "--print-url", "--port", str(port)], tmp_path, env).stdout.strip()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(60):
            with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                break
            time.sleep(0.5)
        browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000"]
        page = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert "Run Name" in page and "pipeline-run-to-find" in page  # the runs table, with the run in it
