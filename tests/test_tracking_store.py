"""The logging step is cached against the store it writes to: a clone's or an emptied store gets the runs,
and read-only commands create no store."""

from __future__ import annotations

import shutil
import sqlite3

import pytest
from conftest import fast_params, make_workspace, ran_steps, run_cli

from tasks.mlflow_store import holds_logged_run, holds_run

# Local facts of one machine: its artifact store, step records, stored plans and MLflow store.
_LOCAL = (".mergeflow/store", ".mergeflow/results", ".mergeflow/plans", "mlflow.db", "mlruns")


def _parent_runs(database) -> int:
    with sqlite3.connect(database) as connection:
        query = "SELECT COUNT(*) FROM tags WHERE key = 'mergeflow.kind' AND value = 'pipeline'"
        return connection.execute(query).fetchone()[0]


def test_holds_run_reads_a_sqlite_store_without_creating_one(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    database = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{database}")
    assert not holds_run(tmp_path, "0" * 32) and not database.exists()
    client = MlflowClient(f"sqlite:///{database}")
    run = client.create_run(client.create_experiment("held"))
    client.set_terminated(run.info.run_id)
    assert holds_run(tmp_path, run.info.run_id)
    assert holds_logged_run(tmp_path, {"summary": {"run_id": run.info.run_id}})
    assert not holds_logged_run(tmp_path, {"summary": {}})
    assert not holds_run(tmp_path, "0" * 32)
    client.delete_run(run.info.run_id)
    assert not holds_run(tmp_path, run.info.run_id)  # deleted in the UI: logged again by the next run


@pytest.mark.parametrize(
    ("code", "held"),
    [("RESOURCE_DOES_NOT_EXIST", False), ("PERMISSION_DENIED", True), ("TEMPORARILY_UNAVAILABLE", True)],
)
def test_a_server_is_taken_to_hold_a_run_unless_it_says_it_does_not(tmp_path, monkeypatch, capsys, code, held):
    from mlflow.exceptions import MlflowException
    from mlflow.protos import databricks_pb2
    from mlflow.tracking import MlflowClient

    def get_run(self, run_id):
        raise MlflowException("no answer", getattr(databricks_pb2, code))

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9/")
    monkeypatch.setattr(MlflowClient, "get_run", get_run)
    assert holds_run(tmp_path, "0" * 32) is held
    assert ("taken as logged" in capsys.readouterr().err) is held  # a store that cannot be asked is said so


def test_read_only_commands_create_no_store(tmp_path, cli_env):
    done = run_cli(["best", "--experiment", "mergeflow"], tmp_path, cli_env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"mergeflow: error: no MLflow store at sqlite:///{tmp_path.resolve() / 'mlflow.db'}: run `mergeflow run` "
        "first, or set MLFLOW_TRACKING_URI"
    ]
    done = run_cli(["ui", "--print-url"], tmp_path, cli_env)
    assert done.returncode == 0 and done.stdout.strip() == "http://127.0.0.1:5000/#/experiments"
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_a_clone_with_the_outputs_logs_its_runs_once_and_an_emptied_store_is_filled(tmp_path, cli_env):
    merge = {"methods": ["average"], "options": {}}
    params = fast_params(merge=merge, federated={"algorithms": ["fedavg"], "rounds": 1})
    original = make_workspace(tmp_path / "original", params)
    done = run_cli(["run"], original, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _parent_runs(original / "mlflow.db") == 1
    _federated_run_spans_its_rounds_and_lists_its_data(original)

    # A clone with the outputs and the stages' shared records (as `dvc pull` brings them), no local state.
    clone = tmp_path / "clone"
    shutil.copytree(original, clone, ignore=lambda folder, names: [n for n in names if n in ("store", "results")])
    for name in _LOCAL:
        path = clone / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    done = run_cli(["run"], clone, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ran_steps(clone) == {"track"}  # nothing is computed again; the clone's store gets the runs
    assert _parent_runs(clone / "mlflow.db") == 1
    assert run_cli(["run"], clone, cli_env).returncode == 0 and ran_steps(clone) == set()
    done = run_cli(["best"], clone, cli_env)
    assert done.returncode == 0 and "average" in done.stdout, done.stderr

    (original / "mlflow.db").unlink()  # a store emptied by hand is filled again, once
    assert run_cli(["run"], original, cli_env).returncode == 0 and ran_steps(original) == {"track"}
    assert _parent_runs(original / "mlflow.db") == 1
    assert run_cli(["run"], original, cli_env).returncode == 0 and ran_steps(original) == set()


def _federated_run_spans_its_rounds_and_lists_its_data(workspace) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("mergeflow").experiment_id
    (run,) = client.search_runs([experiment], "tags.`mergeflow.kind` = 'federated'")
    (parent,) = client.search_runs([experiment], "tags.`mergeflow.kind` = 'pipeline'")
    contexts = {tag.value for d in run.inputs.dataset_inputs for tag in d.tags if tag.key == "mlflow.data.context"}
    assert contexts == {"training", "evaluation"}
    assert parent.info.start_time < run.info.start_time < run.info.end_time < parent.info.end_time
    assert run.data.tags["mergeflow.data"] == parent.data.tags["mergeflow.data"] == "digits"
