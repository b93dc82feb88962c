"""A multi-task run in MLflow, from a synthetic summary (no pipeline run): each model's run logs every task's
metrics and the averages, the pipeline run its references and tasks; `mergeflow best` ranks by the averages
and still ranks only the models of the latest run's data."""

from __future__ import annotations

import pytest
from test_task_scores import OBJECTIVES, _per_task

from flows.cli import main
from mergeflow.task_scores import summarise
from tasks import model_runs
from tasks.tracking import _REFERENCES, _baseline_metrics, _clients, _task_tags

MERGES = ("average", "ties")


@pytest.fixture()
def summary() -> dict:
    summary = summarise(_per_task(), OBJECTIVES)
    summary["sanity"]["tasks"]["low"]["baseline_accuracy"] = 0.3
    return summary


def test_a_models_run_logs_each_tasks_metrics_and_the_averages(summary):
    logged = model_runs.test_metrics(summary["merged/ties"])

    row = summary["merged/ties"]
    assert {key: logged[f"test_{key}"] for key in ("avg_accuracy", "avg_normalized_accuracy", "avg_nll")} == {
        key: row[key] for key in ("avg_accuracy", "avg_normalized_accuracy", "avg_nll")
    }
    for task, scores in row["tasks"].items():
        assert {key: logged[f"{task}.test_{key}"] for key in scores} == scores
    assert len(logged) == 3 + sum(len(scores) for scores in row["tasks"].values())
    single = {"accuracy": 0.9, "nll": 0.3, "by_group": {"a b": {"accuracy": 1.0}}, "client": 2}
    assert model_runs.test_metrics(single) == {
        "test_accuracy": 0.9,
        "test_nll": 0.3,
        "test_a b_accuracy": 1.0,
    }  # as before


def test_the_pipeline_run_names_the_tasks_clients_and_baselines(summary):
    assert _task_tags(summary) == {
        "mergeflow.tasks": "low,high,parity",
        "mergeflow.headline": "test_avg_normalized_accuracy",
    }
    assert _task_tags({"merged/a": {"accuracy": 0.5}}) == {}  # a single-task run: no task tags
    assert _clients({"partition": {"num_clients": 5}}, summary) == [0, 1, 2]
    assert _baseline_metrics(summary["sanity"]) == {"baseline.low.test_accuracy": 0.3}
    assert _baseline_metrics({"baseline_accuracy": 0.25, "warning": None}) == {"baseline.test_accuracy": 0.25}


def _log_multitask_run(mlflow, summary: dict, data: str, test_data: str) -> tuple[str, dict[str, str]]:
    """A multi-task pipeline run and its merges' runs, logged as the tracking step logs them."""
    data_tags = {"mergeflow.data": data, "mergeflow.test_data": test_data, **_task_tags(summary)}
    runs = {}
    with mlflow.start_run(run_name=data, tags={"mergeflow.kind": "pipeline", **data_tags}) as parent:
        references = [name for name in _REFERENCES if name in summary]
        logged = {name: model_runs.test_metrics(summary[name]) for name in references}
        mlflow.log_metrics({f"{name}.{k}": v for name, metrics in logged.items() for k, v in metrics.items()})
        mlflow.log_metrics(_baseline_metrics(summary["sanity"]))
        for name in MERGES:
            tags = {"mergeflow.kind": "merge", "mergeflow.merge": name, "mergeflow.checkpoint_sha256": data + name}
            with mlflow.start_run(run_name=f"merge_{name}", nested=True, tags=tags | data_tags) as run:
                mlflow.log_metrics(model_runs.test_metrics(summary[f"merged/{name}"]))
            runs[name] = run.info.run_id
    return parent.info.run_id, runs


@pytest.fixture()
def experiment(tmp_path, monkeypatch, summary):
    """A multi-task run on other tasks, a single-task run on iris, then a multi-task run on digits tasks."""
    import mlflow

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment_id = mlflow.create_experiment("mergeflow", artifact_location=(tmp_path / "mlruns").as_uri())
    mlflow.set_experiment(experiment_id=experiment_id)
    _log_multitask_run(mlflow, summarise(_per_task(centralized=False), OBJECTIVES), "other_tasks", "o1")
    iris = {"mergeflow.data": "iris", "mergeflow.test_data": "i1"}
    with mlflow.start_run(run_name="iris", tags={"mergeflow.kind": "pipeline", **iris}):
        tags = {"mergeflow.kind": "merge", "mergeflow.merge": "average", "mergeflow.checkpoint_sha256": "i", **iris}
        with mlflow.start_run(run_name="merge_average", nested=True, tags=tags):
            mlflow.log_metric("test_accuracy", 0.99)
    return _log_multitask_run(mlflow, summary, "digits_tasks", "d1")


def _rows(out: str) -> tuple[list[str], list[list[str]]]:
    lines = out.strip().splitlines()
    return lines[0].split(), [line.split() for line in lines[1:]]


@pytest.mark.parametrize("metric", [[], ["--metric", "avg_normalized_accuracy"]], ids=["default", "named"])
def test_best_ranks_a_multitask_run_by_its_average_normalised_accuracy(experiment, summary, capsys, metric):
    parent, runs = experiment
    assert main(["best", "--experiment", "mergeflow", *metric]) == 0
    captured = capsys.readouterr()
    header, rows = _rows(captured.out)
    assert header[2] == "test_avg_normalized_accuracy"
    ranked = sorted(MERGES, key=lambda m: -summary[f"merged/{m}"]["avg_normalized_accuracy"])
    assert [(row[0], row[7]) for row in rows] == [(name, runs[name]) for name in ranked]
    assert [float(row[2]) for row in rows] == [
        pytest.approx(summary[f"merged/{name}"]["avg_normalized_accuracy"], abs=1e-4) for name in ranked
    ]
    assert "2 models of other data (other_tasks) left out" in captured.err  # issue 46: one test split at a time


def test_the_pipeline_run_holds_the_references_averages_and_tasks(experiment, summary):
    import mlflow

    parent, _ = experiment
    run = mlflow.get_run(parent)
    assert run.data.tags["mergeflow.tasks"] == "low,high,parity"
    metrics = run.data.metrics
    for name in ("floor", "individual", "centralized", "base"):
        assert metrics[f"{name}.test_avg_accuracy"] == pytest.approx(summary[name]["avg_accuracy"])
        assert metrics[f"{name}.high.test_accuracy"] == summary[name]["tasks"]["high"]["accuracy"]
    assert metrics["individual.test_avg_normalized_accuracy"] == pytest.approx(1.0)


def test_best_by_another_average_and_all_data_mixes_in_single_task_runs_only_when_asked(experiment, capsys):
    assert main(["best", "--experiment", "mergeflow", "--metric", "avg_nll"]) == 0
    header, rows = _rows(capsys.readouterr().out)
    assert header[2] == "test_avg_nll" and [row[0] for row in rows] == ["ties", "average"]  # lowest first
    assert main(["best", "--experiment", "mergeflow", "--metric", "test_accuracy", "--all-data"]) == 0
    _, rows = _rows(capsys.readouterr().out)
    assert [(row[0], row[4]) for row in rows] == [("average", "iris")]  # the multi-task runs log no test_accuracy


def test_which_way_the_multitask_metrics_improve_and_the_runs_data_name():
    from mergeflow.metric_direction import lower_is_better
    from tasks.tracking_params import tasks_label

    higher = ("avg_normalized_accuracy", "test_avg_accuracy", "loss.test_normalized_accuracy", "val_avg_accuracy")
    lower = ("avg_nll", "test_avg_nll", "accuracy.test_nll", "floor.news.test_perplexity")
    assert not any(lower_is_better(metric) for metric in higher)
    assert all(lower_is_better(metric) for metric in lower)
    assert tasks_label(["low", "high", "parity"]) == "low-high-parity"
