"""What the read-only commands ask MLflow, from its records only (no torch): ``mergeflow best``, an experiment's
best merged and federated models ranked among models scored on the same test split, and ``mergeflow ui``'s page
of an experiment's runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergeflow.errors import MergeflowError
from mergeflow.metric_direction import lower_is_better
from tasks.mlflow_store import require_store, store_exists, tracking_uri
from tasks.model_registry import registered_model_name

_UNSET = ("{}", "[]", "null", "None", "")  # a logged value that means no setting, as an absent param does
_UNKNOWN = "?"  # the data of a run logged before runs named it
DEFAULT_METRIC = "test_accuracy"  # what ranks a run that names no headline (a single-task run)


def runs_url(root: Path, experiment: str, base: str) -> str:
    """The MLflow UI page of ``experiment``'s runs under ``base`` (e.g. ``http://127.0.0.1:5000``).

    MLflow 3's UI opens an experiment on its GenAI overview unless the browser chose otherwise (the
    choice lives in the browser's local storage, not on the server); ``workflowType=machine_learning``
    in the URL opens the runs table. The experiment list when the experiment does not exist yet (nor the
    store: this creates none).
    """
    if not store_exists(root):
        return f"{base}/#/experiments"
    from mlflow.tracking import MlflowClient

    found = MlflowClient(tracking_uri(root)).get_experiment_by_name(experiment)
    if found is None:
        return f"{base}/#/experiments"
    return f"{base}/#/experiments/{found.experiment_id}/runs?workflowType=machine_learning"


@dataclass
class Ranking:
    """The rows of ``mergeflow best``, the data they were ranked on (None: across all data) and how many
    models of other data were left out."""

    rows: list[dict[str, Any]]
    metric: str = DEFAULT_METRIC
    data: str | None = None
    left_out: int = 0
    other_data: list[str] = field(default_factory=list)


def best_runs(root: Path, experiment: str, metric: str | None, top: int = 5, all_data: bool = False) -> Ranking:
    """The best merged and federated models of an experiment by ``metric`` (lowest first where lower is better:
    :func:`mergeflow.metric_direction.lower_is_better`).

    ``metric`` is a logged metric (``test_accuracy``), or a metric as ``metrics/evaluate.json`` names it, read as
    its test value where no run logged it by that name (``avg_normalized_accuracy``: ``test_avg_normalized_accuracy``);
    None: the headline the latest run names (a multi-task run's ``mergeflow.headline`` tag), else
    :data:`DEFAULT_METRIC`. :attr:`Ranking.metric` is the logged metric ranked.

    Only models scored on the same test split compare: by default those of the data of the latest pipeline
    run (``all_data`` ranks every model). Each model (by checkpoint sha256) counts once, with the run that
    the latest pipeline run logging it made. Each row has the model's ``name``, ``kind`` and ``data``, the
    metric, ``run_id``, ``started`` (local time, to the minute), ``version`` (its version in the Model
    Registry, or None) and ``differs``: for rows of the same name, the params (the run's own and its
    pipeline's) whose values differ between them, else nothing.
    """
    uri = require_store(root)
    import mlflow

    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        raise MergeflowError(f"tracking.experiment: no MLflow experiment {experiment!r} at {uri}")
    every = mlflow.search_runs(experiment_names=[experiment])
    for tag in ("tags.mergeflow.test_data", "tags.mergeflow.data"):
        every[tag] = every[tag].fillna(_UNKNOWN) if tag in every.columns else _UNKNOWN
    latest = _latest_run(every)
    metric = _logged_metric(every, metric, latest)
    ascending = lower_is_better(metric)
    column = f"metrics.{metric}"
    if every.empty or column not in every.columns:
        raise MergeflowError(f"--metric: no run of experiment {experiment!r} has a metric {metric!r}")
    pipelines = every[every["tags.mergeflow.kind"] == "pipeline"].set_index("run_id")["start_time"]
    runs = every[every["tags.mergeflow.kind"].isin(["merge", "federated"]) & every[column].notna()].copy()
    if runs.empty:
        return Ranking(rows=[], metric=metric)
    # The same model is logged again by every later pipeline run, its run spanning the step that made it (the
    # same times each time): keep the run of the latest pipeline run.
    runs["pipeline_start"] = runs["tags.mlflow.parentRunId"].map(pipelines)  # model runs are nested: a parent
    runs = runs.sort_values(["pipeline_start", "start_time"], ascending=False, kind="stable", na_position="last")
    runs = runs.drop_duplicates("tags.mergeflow.checkpoint_sha256")
    ranking = Ranking(rows=[], metric=metric)
    if not all_data:
        same = runs["tags.mergeflow.test_data"] == latest["tags.mergeflow.test_data"]
        ranking.data, ranking.left_out = latest["tags.mergeflow.data"], int((~same).sum())
        ranking.other_data = sorted(set(runs[~same]["tags.mergeflow.data"]))
        runs = runs[same]
    runs = runs.sort_values(column, ascending=ascending, kind="stable").head(top)
    by_id = every.set_index("run_id")
    params = []
    for _, row in runs.iterrows():
        ranking.rows.append(
            {
                "name": row.get(f"tags.mergeflow.{row['tags.mergeflow.kind']}"),
                "kind": row["tags.mergeflow.kind"],
                "data": row["tags.mergeflow.data"],
                metric: float(row[column]),
                "run_id": row["run_id"],
                "started": row["start_time"].to_pydatetime().astimezone().strftime("%Y-%m-%d %H:%M"),
                "version": _registered_version(mlflow, experiment, row),
            }
        )
        parent_id = row.get("tags.mlflow.parentRunId")
        params.append(_run_params(row, by_id.loc[parent_id] if parent_id in by_id.index else None))
    names = [(row["name"], row["data"]) for row in ranking.rows]
    for row, differs in zip(ranking.rows, _differences(names, params), strict=True):
        row["differs"] = differs
    return ranking


def _latest_run(every: Any) -> Any:
    """The latest pipeline, merge or federated run of ``search_runs``' rows; None for none."""
    if "tags.mergeflow.kind" not in every.columns:
        return None
    logged = every.loc[every["tags.mergeflow.kind"].isin(["pipeline", "merge", "federated"])]
    return None if logged.empty else logged.sort_values("start_time", ascending=False, kind="stable").iloc[0]


def _logged_metric(every: Any, metric: str | None, latest: Any) -> str:
    """The logged metric that ``best_runs``' ``metric`` names (its docstring)."""
    if metric is None:
        named = latest.get("tags.mergeflow.headline") if latest is not None else None
        return named if isinstance(named, str) else DEFAULT_METRIC
    if f"metrics.{metric}" not in every.columns and f"metrics.test_{metric}" in every.columns:
        return f"test_{metric}"
    return metric


def _run_params(run: Any, parent: Any) -> dict[str, str]:
    """A model run's params (a row of ``search_runs``, one column per param of any run) with its pipeline run's,
    but for the pipeline's merges and algorithms: the model run logs its own options."""
    inherited = {} if parent is None else _logged_params(parent)
    inherited = {key: value for key, value in inherited.items() if not key.startswith(("merge.", "federated."))}
    return inherited | _logged_params(run)


def _logged_params(run: Any) -> dict[str, str]:
    """A ``search_runs`` row's params, without the values that mean no setting (``{}``, ``null``)."""
    return {
        key.removeprefix("params."): v
        for key, v in run.items()
        if key.startswith("params.") and isinstance(v, str) and v not in _UNSET
    }


def _differences(names: list[Any], params: list[dict[str, str]]) -> list[dict[str, str]]:
    """For each row, the params whose values differ among the rows of its name (``unset`` where absent)."""
    differs: list[dict[str, str]] = []
    for name, mine in zip(names, params, strict=True):
        same = [other for other_name, other in zip(names, params, strict=True) if other_name == name]
        keys = sorted({key for other in same for key in other if len({o.get(key) for o in same}) > 1})
        differs.append({key: mine.get(key, "unset") for key in keys})
    return differs


def _registered_version(mlflow, experiment: str, run: Any) -> int | None:
    """The Model Registry version that holds a merge run's checkpoint (by sha256), if it was registered."""
    if run["tags.mergeflow.kind"] != "merge" or run["tags.mergeflow.data"] == _UNKNOWN:
        return None
    name = registered_model_name(experiment, run["tags.mergeflow.data"], run["tags.mergeflow.merge"])
    digest = run["tags.mergeflow.checkpoint_sha256"]
    versions = mlflow.tracking.MlflowClient().search_model_versions(f"name='{name}'")
    return next((int(v.version) for v in versions if v.tags.get("mergeflow.checkpoint_sha256") == digest), None)
