"""`mergeflow ui --print-url` gives the experiment's runs page, not MLflow 3's GenAI overview."""

from __future__ import annotations

import os

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
