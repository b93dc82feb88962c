"""A client whose training diverges: `finetune.on_divergence: fail` stops with one clear error,
`exclude` merges the others, and the decision is recorded in the outputs and in MLflow."""

from __future__ import annotations

import json

import pytest
from conftest import fast_params, make_workspace, ran_steps, run_cli

pytestmark = pytest.mark.slow

DIVERGING = ["-S", "finetune.clients.1.lr=1e12"]  # overflows to NaN within the first epoch


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    params = fast_params(merge={"methods": ["average", "fisher"], "options": {}}, federated={"algorithms": []})
    return make_workspace(tmp_path_factory.mktemp("divergence"), params)


def test_fail_stops_with_one_line_naming_the_client(workspace, cli_env):
    done = run_cli(["run", *DIVERGING], workspace, cli_env)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("mergeflow: error:")]
    assert len(errors) == 1
    assert "finetune.on_divergence" in errors[0] and "client 1" in errors[0] and "nan" in errors[0]
    assert not (workspace / "models/merged").exists()


def test_exclude_merges_the_other_clients_without_retraining_and_logs_the_decision(workspace, cli_env):
    import mlflow

    done = run_cli(["run", *DIVERGING, "-S", "finetune.on_divergence=exclude"], workspace, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not any(step.startswith("finetune/") for step in ran_steps(workspace))  # the policy re-trains nothing
    from mergeflow.checkpoints import load_checkpoint

    _, meta = load_checkpoint(workspace / "models/merged/average.safetensors")
    assert meta["excluded_clients"] == [1]
    metrics = json.loads((workspace / "metrics/evaluate.json").read_text())
    assert metrics["client_001"]["diverged"] is True
    assert metrics["best_client"]["client"] != 1
    assert json.loads((workspace / "metrics/align.json").read_text())["excluded"] == [1]

    mlflow.set_tracking_uri(f"sqlite:///{workspace / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["mergeflow"])
    clients = runs[runs["tags.mergeflow.kind"] == "client"].set_index("tags.mergeflow.client")
    assert (
        clients.loc["1", "tags.mergeflow.diverged"] == "true" and clients.loc["0", "tags.mergeflow.diverged"] == "false"
    )
    merges = runs[runs["tags.mergeflow.kind"] == "merge"]
    assert set(merges["params.excluded_clients"]) == {"1"}
