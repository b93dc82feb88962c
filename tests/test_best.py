"""`mergeflow best`: rows of one merge are told apart by registry version, start date and the params that differ."""

from __future__ import annotations

import re

import pytest

from flows.cli import main


@pytest.fixture()
def experiment(tmp_path, monkeypatch):
    """Three pipeline runs that logged task_arithmetic (two scalings, two client learning rates) and one average;
    the second task_arithmetic model is registered."""
    import mlflow

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment_id = mlflow.create_experiment("mergeflow", artifact_location=(tmp_path / "mlruns").as_uri())
    mlflow.set_experiment(experiment_id=experiment_id)  # nested runs follow the active experiment
    logged = {}
    for scaling, lr, accuracy, digest in (
        ("0.3", "0.05", 0.9, "a"),
        ("0.5", "0.05", 0.95, "b"),
        ("0.3", "0.1", 0.8, "c"),
    ):
        with mlflow.start_run(experiment_id=experiment_id, run_name="pipeline", tags={"mergeflow.kind": "pipeline"}):
            mlflow.log_params({"finetune.lr": lr, "merge.options.task_arithmetic.scaling": scaling, "seed": "0"})
            merges = [("task_arithmetic", {"option.scaling": scaling}, accuracy, digest)]
            merges += [("average", {}, 0.85, "avg")] if digest == "a" else []
            for name, options, value, sha in merges:
                tags = {"mergeflow.kind": "merge", "mergeflow.merge": name, "mergeflow.checkpoint_sha256": sha}
                with mlflow.start_run(run_name=f"merge_{name}", nested=True, tags=tags) as run:
                    mlflow.log_params({"method": name, **options})
                    mlflow.log_metric("test_accuracy", value)
                logged[sha] = run.info.run_id
    client = mlflow.tracking.MlflowClient()
    client.create_registered_model("mergeflow.task_arithmetic")
    source = (tmp_path / "model").as_uri()
    version = client.create_model_version(
        "mergeflow.task_arithmetic", source, run_id=logged["b"], tags={"mergeflow.checkpoint_sha256": "b"}
    )
    return logged, version.version


def test_best_shows_version_date_and_the_params_that_differ(experiment, capsys):
    logged, version = experiment
    assert main(["best", "--metric", "test_accuracy", "--experiment", "mergeflow"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["name", "kind", "test_accuracy", "version", "started", "run_id", "differs"]
    rows = [line.split() for line in lines[1:]]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", f"{row[4]} {row[5]}") for row in rows)
    # (name, accuracy, version, run, the params that differ); merge.options.* is the run's own option.scaling
    expected = [
        ["task_arithmetic", "0.9500", f"v{version}", logged["b"], "finetune.lr=0.05", "option.scaling=0.5"],
        ["task_arithmetic", "0.9000", "-", logged["a"], "finetune.lr=0.05", "option.scaling=0.3"],
        ["average", "0.8500", "-", logged["avg"]],
        ["task_arithmetic", "0.8000", "-", logged["c"], "finetune.lr=0.1", "option.scaling=0.3"],
    ]
    assert [[row[0], *row[2:4], *row[6:]] for row in rows] == expected
