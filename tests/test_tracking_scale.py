"""MLflow at many clients: past ``tracking.client_runs`` clients, the parent run holds the clients' aggregates and a
table of every client instead of a child run each; at or below it, each client has its run as before."""

from __future__ import annotations

import json
import math

import pytest
from conftest import fast_params, make_workspace, ran_steps, run_cli

from mergeflow.config import TrackingConfig
from tasks.client_summary import CLIENT_TABLE, client_aggregates, client_row


def test_client_runs_are_logged_up_to_the_setting():
    def logged(setting, clients: int) -> bool:
        return TrackingConfig(client_runs=setting).logs_client_runs(clients)

    assert logged("auto", 20) and not logged("auto", 21)
    assert logged("all", 1000) and not logged("none", 1)
    assert logged(2, 2) and not logged(2, 3) and not logged(0, 1)


def test_aggregates_cover_each_measure_over_the_clients_that_have_a_finite_one():
    rows = [
        {"client": 0, "num_examples": 10, "diverged": False, "test_accuracy": 0.5, "lr": "0.1"},
        {"client": 1, "num_examples": 30, "diverged": False, "test_accuracy": 0.7, "lr": "0.1"},
        {"client": 2, "num_examples": 20, "diverged": True, "test_accuracy": math.nan, "lr": "0.1"},
        {"client": 3, "num_examples": 40, "diverged": False, "low.test_accuracy": 0.9, "lr": "0.1"},
    ]
    aggregates = client_aggregates(rows)
    assert aggregates["clients.count"] == 4 and aggregates["clients.diverged"] == 1
    assert aggregates["clients.test_accuracy_mean"] == pytest.approx(0.6)  # the diverged client's NaN left out
    assert aggregates["clients.test_accuracy_std"] == pytest.approx(0.1)
    assert (aggregates["clients.test_accuracy_min"], aggregates["clients.test_accuracy_max"]) == (0.5, 0.7)
    assert aggregates["clients.num_examples_median"] == 25 and aggregates["clients.num_examples_p90"] == 37
    assert aggregates["clients.low.test_accuracy_mean"] == 0.9  # a task's metric over its own clients
    assert not any(key.startswith(("clients.client_", "clients.lr", "clients.diverged_")) for key in aggregates)


def test_a_clients_row_holds_its_task_training_or_given_source_and_scores(tmp_path):
    import torch

    from mergeflow.checkpoints import save_checkpoint
    from tasks.layout import client_checkpoint

    given = {"source": "hub:some/model", "kind": "transformers", "files": {"model.safetensors": "ab12"}}
    metas = {
        0: {"num_examples": 8, "task": "low", "train": {"lr": 0.1}, "step_losses": [0.9, 0.4]},
        1: {"num_examples": 5, "task": "high", "diverged": True, "given": given},
    }
    for client, meta in metas.items():
        (tmp_path / client_checkpoint(client)).parent.mkdir(parents=True, exist_ok=True)
        save_checkpoint(tmp_path / client_checkpoint(client), {"w": torch.zeros(1)}, meta)
    scores = {"client_000": {"accuracy": 0.75, "client": 0}, "client_001": {"accuracy": 0.5, "client": 1}}
    rows = [client_row(tmp_path, client, scores) for client in metas]
    assert rows[0] == {
        **{"client": 0, "task": "low", "num_examples": 8, "diverged": False, "train_loss": 0.4},
        **{"test_accuracy": 0.75, "lr": "0.1"},
    }
    assert rows[1] == {
        **{"client": 1, "task": "high", "num_examples": 5, "diverged": True, "test_accuracy": 0.5},
        **{"given.source": "hub:some/model", "given.kind": "transformers", "given.sha256": "ab12"},
    }


def _runs(workspace, kind: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("mergeflow").experiment_id
    return client.search_runs([experiment], f"tags.`mergeflow.kind` = '{kind}'", order_by=["start_time DESC"])


@pytest.mark.slow
def test_past_the_setting_the_parent_run_summarises_the_clients_and_a_change_logs_their_runs(tmp_path, cli_env):
    import pandas as pd
    from mlflow.tracking import MlflowClient

    merge = {"methods": ["average"], "options": {}}
    params = fast_params(merge=merge, federated={"algorithms": ["fedavg"], "rounds": 1}, tracking={"client_runs": 2})
    workspace = make_workspace(tmp_path / "project", params)
    done = run_cli(["run"], workspace, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]

    assert _runs(workspace, "client") == []
    assert len(_runs(workspace, "merge")) == len(_runs(workspace, "federated")) == 1  # they keep their runs
    (parent,) = _runs(workspace, "pipeline")
    scores = json.loads((workspace / "metrics" / "evaluate.json").read_text())
    accuracies = [scores[f"client_{client:03d}"]["accuracy"] for client in range(3)]
    assert parent.data.metrics["clients.count"] == 3
    assert parent.data.metrics["clients.test_accuracy_mean"] == pytest.approx(sum(accuracies) / 3)
    assert parent.data.metrics["clients.test_accuracy_min"] == pytest.approx(min(accuracies))
    # A table artifact (what the UI shows as a table, and `mlflow.load_table` reads), in pandas' split layout.
    assert {"path": CLIENT_TABLE, "type": "table"} in json.loads(parent.data.tags["mlflow.loggedArtifacts"])
    store = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    table = pd.read_json(store.download_artifacts(parent.info.run_id, CLIENT_TABLE, str(tmp_path)), orient="split")
    assert table["client"].tolist() == [0, 1, 2]
    assert table["test_accuracy"].tolist() == pytest.approx(accuracies)
    assert (table["num_examples"] > 0).all() and "lr" in table.columns and not table["diverged"].any()

    done = run_cli(["run", "-S", "tracking.client_runs=auto"], workspace, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ran_steps(workspace) == {"track"}  # a change of the setting logs again, and computes nothing
    clients = _runs(workspace, "client")
    assert sorted(run.data.tags["mergeflow.client"] for run in clients) == ["0", "1", "2"]
    latest = _runs(workspace, "pipeline")[0]
    assert {run.data.tags["mlflow.parentRunId"] for run in clients} == {latest.info.run_id}
    assert "clients.count" not in latest.data.metrics  # at or below the setting: as before, the runs only
    first = next(run for run in clients if run.data.tags["mergeflow.client"] == "0")  # what its row said
    assert first.data.metrics["test_accuracy"] == pytest.approx(accuracies[0])
    assert first.data.params["num_examples"] == str(table["num_examples"][0])
    assert first.data.params["lr"] == str(table["lr"][0]) and first.inputs.dataset_inputs
    losses = store.get_metric_history(first.info.run_id, "train_loss")
    assert len(losses) > 1 and losses[-1].value == pytest.approx(table["train_loss"][0])
    done = run_cli(["best"], workspace, cli_env)
    assert done.returncode == 0 and "client" not in done.stdout, done.stdout + done.stderr
