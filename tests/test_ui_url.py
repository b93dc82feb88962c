"""`mergeflow ui --print-url` gives the experiment's runs page, not MLflow 3's GenAI overview."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import browser_page, free_port, run_cli


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
    page = browser_page(tmp_path, free_port(), env, showing="pipeline-run-to-find")
    assert "Run Name" in page and "pipeline-run-to-find" in page  # the runs table, with the run in it
