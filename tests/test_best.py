"""`mergeflow best`: rows of one merge are told apart by registry version, start date and the params that differ;
only models scored on the same test split are ranked together."""

from __future__ import annotations

import re

import pytest

from flows.cli import main


@pytest.fixture()
def experiment(tmp_path, monkeypatch):
    """Three pipeline runs on digits that logged task_arithmetic (two scalings, two client learning rates) and
    one average, then one on iris whose average scored higher; the second task_arithmetic model is registered."""
    import mlflow

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment_id = mlflow.create_experiment("mergeflow", artifact_location=(tmp_path / "mlruns").as_uri())
    mlflow.set_experiment(experiment_id=experiment_id)  # nested runs follow the active experiment
    logged = {}
    digits = {"mergeflow.data": "digits", "mergeflow.test_data": "d1"}
    for scaling, lr, accuracy, digest, data in (
        ("0.3", "0.05", 0.9, "a", digits),
        ("0.5", "0.05", 0.95, "b", digits),
        ("0.3", "0.1", 0.8, "c", digits),
        ("0.3", "0.05", 1.0, "iris", {"mergeflow.data": "iris", "mergeflow.test_data": "i1"}),
    ):
        with mlflow.start_run(experiment_id=experiment_id, run_name="pipeline", tags={"mergeflow.kind": "pipeline"}):
            # One run logged "no per-client settings" as {}, the others left it out: the same setting.
            empty = {"finetune.clients": "{}"} if digest == "b" else {}
            mlflow.log_params({"finetune.lr": lr, "merge.options.task_arithmetic.scaling": scaling} | empty)
            merges = [("task_arithmetic", {"option.scaling": scaling}, accuracy, digest)] if digest != "iris" else []
            merges += [("average", {}, 0.85, "avg")] if digest == "a" else []
            merges += [("average", {}, 1.0, "iris")] if digest == "iris" else []
            for name, options, value, sha in merges:
                tags = {"mergeflow.kind": "merge", "mergeflow.merge": name, "mergeflow.checkpoint_sha256": sha, **data}
                with mlflow.start_run(run_name=f"merge_{name}", nested=True, tags=tags) as run:
                    mlflow.log_params({"method": name, **options})
                    mlflow.log_metric("test_accuracy", value)
                logged[sha] = run.info.run_id
    client = mlflow.tracking.MlflowClient()
    client.create_registered_model("mergeflow.digits.task_arithmetic")
    source = (tmp_path / "model").as_uri()
    version = client.create_model_version(
        "mergeflow.digits.task_arithmetic", source, run_id=logged["b"], tags={"mergeflow.checkpoint_sha256": "b"}
    )
    return logged, version.version


def test_best_shows_version_date_and_the_params_that_differ(experiment, capsys):
    logged, version = experiment
    assert main(["best", "--metric", "test_accuracy", "--experiment", "mergeflow", "--all-data"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["name", "kind", "test_accuracy", "version", "data", "started", "run_id", "differs"]
    rows = [line.split() for line in lines[1:]]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", f"{row[5]} {row[6]}") for row in rows)
    assert [row[4] for row in rows] == ["iris", "digits", "digits", "digits", "digits"]
    # (name, accuracy, version, run, the params that differ); merge.options.* is the run's own option.scaling
    expected = [
        ["average", "1.0000", "-", logged["iris"]],  # the only iris row: its params differ from no other row's
        ["task_arithmetic", "0.9500", f"v{version}", logged["b"], "finetune.lr=0.05", "option.scaling=0.5"],
        ["task_arithmetic", "0.9000", "-", logged["a"], "finetune.lr=0.05", "option.scaling=0.3"],
        ["average", "0.8500", "-", logged["avg"]],
        ["task_arithmetic", "0.8000", "-", logged["c"], "finetune.lr=0.1", "option.scaling=0.3"],
    ]
    assert [[row[0], *row[2:4], *row[7:]] for row in rows] == expected


def test_best_ranks_the_latest_runs_data_only_unless_asked(experiment, capsys):
    logged, _ = experiment
    assert main(["best", "--experiment", "mergeflow"]) == 0
    captured = capsys.readouterr()
    rows = [line.split() for line in captured.out.strip().splitlines()[1:]]
    assert [(row[0], row[4], row[7]) for row in rows] == [("average", "iris", logged["iris"])]
    assert captured.err.strip() == (
        "mergeflow: best: ranked on the data of the latest run (iris); 4 models of other data (digits) left out: "
        "--all-data ranks them together"
    )


def test_best_reads_mlflow_without_importing_torch(experiment, tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from flows.cli import main; code = main(['best', '--experiment', 'mergeflow']); "
        "sys.exit(code or 3 * ('torch' in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_which_way_a_metric_improves_is_read_from_its_name():
    from mergeflow.metric_direction import lower_is_better

    lower = ("test_nll", "test_perplexity", "round_train_loss", "barrier_before_mean", "cg_relative_residual", "mae")
    higher = ("test_accuracy", "test_accuracy_gain", "test_loss_group_accuracy", "soup_score", "cg_iterations")
    assert all(lower_is_better(metric) for metric in lower)
    assert not any(lower_is_better(metric) for metric in higher)
