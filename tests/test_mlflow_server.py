"""The pipeline against a real MLflow tracking server (SQLite backend, proxied artifact store)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import fast_params, free_port, make_workspace, run_cli, stop, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture()
def mlflow_server(tmp_path):
    port = free_port()
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
        "--artifacts-destination", str(tmp_path / "artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    server = subprocess.Popen(
        command, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    uri = f"http://127.0.0.1:{port}"
    wait_for(f"{uri}/health", server)
    try:
        yield uri, tmp_path / "artifacts"
    finally:
        stop(server)


def test_the_pipeline_logs_runs_models_and_registry_versions_to_a_tracking_server(tmp_path, cli_env, mlflow_server):
    import mlflow

    uri, artifacts = mlflow_server
    params = fast_params(merge={"methods": ["average", "fisher"], "options": {}}, federated={"algorithms": ["fedavg"]})
    path = make_workspace(tmp_path / "ws", params)
    env = {**cli_env, "MLFLOW_TRACKING_URI": uri}
    done = run_cli(["run"], path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (path / "mlflow.db").exists()  # everything went to the server

    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["mergeflow"])
    assert sorted(runs["tags.mergeflow.kind"]) == ["client"] * 3 + ["federated", "merge", "merge", "pipeline"]
    client = mlflow.tracking.MlflowClient()
    versions = client.search_model_versions("name='mergeflow.digits.fisher'")
    assert len(versions) == 1 and versions[0].tags["mergeflow.params_hash"]
    assert any(artifacts.rglob("*.safetensors"))  # the checkpoints were uploaded through the server

    done = run_cli(["best", "--metric", "test_accuracy"], path, env)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip().splitlines()) == 1 + 3  # header, two merges, one federated model
