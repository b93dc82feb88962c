"""The tracking step: MLflow logging of a pipeline's results, a parent run with one child per merge and federated
algorithm (:mod:`tasks.model_runs`) and, up to ``tracking.client_runs`` clients, per client; a run with more logs
its clients in the parent run (:mod:`tasks.client_summary`).

The logging step is cached like any other: its key covers the evaluated artifacts, the
params and the tracking URI, so re-running an unchanged pipeline logs nothing twice,
while pointing at a new tracking server logs the results there.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mergeflow.config import Params, TrackingConfig
from mergeflow.import_graph import third_party_versions
from mergeflow.task_scores import headline, is_summary
from tasks.client_summary import log_client_summary
from tasks.layout import (
    ALIGN_METRICS,
    BARRIER_PLOT,
    DATA_METRICS,
    FEDERATED_METRICS,
    FEDERATED_PLOT,
    METRICS,
    PARTITION_METRICS,
    PARTITION_PLOT,
    PARTITIONS,
    PLOT,
    PREPARED,
    SELECTION,
    SELECTION_PLOT,
    TaskPaths,
    client_checkpoint,
)
from tasks.mlflow_flavours import input_example
from tasks.mlflow_logging import experiment_id, flatten, log_params
from tasks.mlflow_store import is_remote, tracking_uri
from tasks.model_runs import SPLIT_CONTEXTS, log_client, log_dataset, log_federated, log_merge, test_metrics
from tasks.provenance import run_started, step_devices, step_times
from tasks.reports import SANITY
from tasks.steps import Step
from tasks.store import STATE_DIR, hash_paths, sha256_file
from tasks.tracking_params import data_label, params_in_use, run_name, tasks_label

# Files logged as artifacts of the parent run.
_ARTIFACTS = (
    DATA_METRICS,
    METRICS,
    SELECTION,
    PLOT,
    PARTITION_METRICS,
    PARTITION_PLOT,
    ALIGN_METRICS,
    BARRIER_PLOT,
    FEDERATED_METRICS,
    FEDERATED_PLOT,
)
STANDARDIZED = "data.standardized"  # a param the data step chose, logged beside the params in use
# The models every merge is judged against, logged in the parent run as <name>.test_<metric>: single-task
# base, centralized, ensemble and best client; multi-task (mergeflow.task_scores) floor, individual, best single.
_REFERENCES = ("base", "centralized", "ensemble", "best_client", "floor", "individual", "best_single")


def plan_track(params: Params) -> list[Step]:
    """One step that logs the whole pipeline's results to MLflow."""
    clients = tuple(client_checkpoint(ref.index) for ref in params.clients)
    tasks = [TaskPaths(task) for task in params.task_names]
    merged = tuple(paths.merged_checkpoint(m) for m in params.merge.methods for paths in tasks)
    step_params = {
        "params": params.model_dump(mode="json", exclude={"orchestration"}),
        "in_use": params_in_use(params),  # what the pipeline run logs as its params
        "data": tasks_label(params.tasks) if params.multitask else data_label(params),
        "uri": os.environ.get("MLFLOW_TRACKING_URI", "local"),
    }
    rounds = params.federated.rounds
    federated = tuple(paths.global_checkpoint(a, rounds) for a in params.federated.algorithms for paths in tasks)
    inputs = (*_ARTIFACTS, *clients, *merged, *federated)
    # A hit only while the store still holds the logged runs: a pulled clone's or an emptied store is filled.
    # The record of a run logged to a server travels with the data: a clone that logs there too finds it.
    holds, local = "tasks.mlflow_store:holds_logged_run", not is_remote(step_params["uri"])
    return [
        Step(
            "track",
            "tasks.tracking:track",
            step_params,
            inputs=inputs,
            holds=holds,
            local=local,
            members=params.model_members,
        )
    ]


def track(params: dict[str, Any], root: Path, out: Path, _settings: dict[str, Any]) -> dict[str, Any]:
    """Log the parent pipeline run and its client (or clients' summary), merge and federated child runs."""
    with _tracking_lock(root):
        return _track(params, root)


@contextlib.contextmanager
def _tracking_lock(root: Path) -> Iterator[None]:
    """One MLflow writer per project at a time: concurrent first use of a SQLite store breaks its
    schema migration, and two pipelines may finish together (schedules, parallel experiments)."""
    lock = root / STATE_DIR / "mlflow.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _git_commit(root: Path) -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() or "unknown"


def _digest(hashes: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()[:16]


def _barrier_metrics(report: dict[str, Any]) -> dict[str, float]:
    """``barrier_before_mean`` (and ``_after``, ``_repaired`` with REPAIR): the mean loss barrier from the reference
    to the other clients. Each client's curve and barrier are in ``metrics/align.json``, an artifact of the run."""
    phases = {phase: report.get(phase, {}) for phase in ("before", "after", "repaired")}
    return {
        f"barrier_{phase}_mean": sum(float(c["barrier"]) for c in curves.values()) / len(curves)
        for phase, curves in phases.items()
        if curves
    }


def _log_data(mlflow, root: Path, infos: dict[str | None, dict[str, Any]], sanity: dict[str, Any]) -> None:
    """The prepared splits (every task's) as dataset inputs, the feature encoding's choices, and the input-blind
    baseline (with the run's warning as the ``mergeflow.warning`` tag when the models did not beat it)."""
    for task, info in infos.items():
        prepared = TaskPaths(task).prepared
        for split, context in SPLIT_CONTEXTS.items():
            if (root / prepared / f"{split}.parquet").is_file():
                log_dataset(mlflow, root, f"{prepared}/{split}.parquet", info, context)
    report = json.loads((root / DATA_METRICS).read_text())
    reports = report if None not in infos else {None: report}  # a multi-task run's: by task
    for task, own in reports.items():
        prefix = "" if task is None else f"{task}."
        mlflow.log_params({f"{prefix}{STANDARDIZED}": str(own["standardized"]).lower()})
        if "standardize_reason" in own:
            mlflow.set_tag(f"mergeflow.{prefix}standardize_reason", own["standardize_reason"])
    mlflow.log_metrics(_baseline_metrics(sanity))
    if sanity["warning"]:
        mlflow.set_tag("mergeflow.warning", sanity["warning"])


def _baseline_metrics(sanity: dict[str, Any], prefix: str = "baseline.") -> dict[str, float]:
    """The input-blind baseline's test score (``baseline.test_accuracy``, ``_mse``); in a multi-task run each
    task's (``baseline.<task>.test_accuracy``)."""
    scores = {k: v for k, v in sanity.items() if k in ("baseline_accuracy", "baseline_mse")}
    metrics = {f"{prefix}test_{k.removeprefix('baseline_')}": float(v) for k, v in scores.items()}
    for task, report in sanity.get("tasks", {}).items():
        metrics |= _baseline_metrics(report, f"{prefix}{task}.")
    return metrics


def _task_tags(metrics: dict[str, Any]) -> dict[str, str]:
    """A multi-task run's tags (none for a single-task run): ``mergeflow.tasks``, its tasks' names, and
    ``mergeflow.headline``, the metric that ranks its models (``mergeflow best``'s default)."""
    if not is_summary(metrics):
        return {}
    return {"mergeflow.tasks": ",".join(metrics["tasks"]), "mergeflow.headline": f"test_{headline(metrics)}"}


def _clients(config: dict[str, Any], metrics: dict[str, Any]) -> list[int]:
    """The clients' global ids: every task's in a multi-task run."""
    if is_summary(metrics):
        return [client for task in metrics["tasks"].values() for client in task["clients"]]
    return list(range(config["partition"]["num_clients"]))


def _previous_params(mlflow, experiment: str, data: str) -> dict[str, str] | None:
    """The params in use of the experiment's latest finished pipeline run on the data named ``data``; None for
    none."""
    found = mlflow.search_runs(
        experiment_ids=[experiment],
        filter_string=f"tags.`mergeflow.kind` = 'pipeline' and tags.`mergeflow.data` = '{data}' and "
        "attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
        output_format="list",
    )
    return {k: v for k, v in found[0].data.params.items() if k != STANDARDIZED} if found else None


@contextlib.contextmanager
def _pipeline_run(mlflow, experiment: str, name: str, tags: dict[str, str], started: int | None) -> Iterator[Any]:
    """The parent run, from when the pipeline run started (``started``, epoch ms) to the end of its logging."""
    created = mlflow.tracking.MlflowClient().create_run(experiment, start_time=started, tags=tags, run_name=name)
    with mlflow.start_run(run_id=created.info.run_id) as run:
        yield run


def _track(params: dict[str, Any], root: Path) -> dict[str, Any]:
    import mlflow

    from tasks.prepared import read_info

    config = params["params"]
    mlflow.set_tracking_uri(tracking_uri(root))
    experiment = experiment_id(mlflow, config["tracking"]["experiment"], root)
    mlflow.set_experiment(experiment_id=experiment)  # nested child runs follow the active experiment
    metrics = json.loads((root / METRICS).read_text())
    tasks = list(metrics["tasks"]) if is_summary(metrics) else [None]
    infos = {task: read_info(root, TaskPaths(task).prepared) for task in tasks}
    info = infos[tasks[0]]
    example = input_example(root, info, TaskPaths(tasks[0]).prepared)
    # Which data: its name, and the test split's digest (models scored on the same split compare: `best`).
    test_splits = [sha256_file(root / TaskPaths(task).prepared / "test.parquet") for task in tasks]
    test_split = (test_splits[0] if len(tasks) == 1 else hashlib.sha256("".join(test_splits).encode()).hexdigest())[:16]
    data_tags = {"mergeflow.data": params["data"], "mergeflow.test_data": test_split, **_task_tags(metrics)}
    tags = {
        "mergeflow.kind": "pipeline",
        "mergeflow.git_commit": _git_commit(root),
        "mergeflow.data_hash": _digest(hash_paths(root, [PREPARED, PARTITIONS])),
        "mergeflow.params_hash": _digest({"params": json.dumps(config, sort_keys=True)}),
        **data_tags,
        # Cache keys leave third-party versions out (as DVC does): the run says which made its models.
        **{f"mergeflow.version.{name}": version for name, version in third_party_versions().items()},
    }
    logged = flatten(params["in_use"])
    named = run_name(params["data"], logged, _previous_params(mlflow, experiment, params["data"]))
    with _pipeline_run(mlflow, experiment, named, tags, run_started(root)) as parent:
        log_params(mlflow, logged)
        for name in _REFERENCES:
            if name not in metrics:  # a causal LM has no output ensemble; a single-task run no floor
                continue
            mlflow.log_metrics({f"{name}.{k}": v for k, v in test_metrics(metrics[name]).items()})
        for artifact in _ARTIFACTS:
            mlflow.log_artifact(str(root / artifact), Path(artifact).parent.name)
        if json.loads((root / SELECTION).read_text()):
            mlflow.log_artifact(str(root / SELECTION_PLOT), "plots")
        mlflow.log_metrics(_barrier_metrics(json.loads((root / ALIGN_METRICS).read_text())))
        _log_data(mlflow, root, infos, metrics[SANITY])
        context = {
            "experiment": config["tracking"]["experiment"],
            "log_models": config["tracking"]["log_models"],
            "data_hash": tags["mergeflow.data_hash"],
            "data_tags": data_tags,
            "params_hash": tags["mergeflow.params_hash"],
            "info": info,
            "infos": infos,
            "times": step_times(root),
            "registered": [],
            "not_registered": [],
            "devices": step_devices(root),
        }
        made_on = sorted({facts.get("device_name", facts["device"]) for facts in context["devices"].values()})
        if made_on:  # the devices this run's models were made on (several: a run that reused other devices' steps)
            mlflow.set_tag("mergeflow.devices", ", ".join(made_on))
        clients = _clients(config, metrics)
        if TrackingConfig.model_validate(config["tracking"]).logs_client_runs(len(clients)):
            for client in clients:
                log_client(mlflow, root, client, metrics, context)
        else:  # too many to browse, or to log in seconds, as runs: aggregates and a table in the parent run
            log_client_summary(mlflow, root, clients, metrics)
        for name in config["merge"]["methods"]:
            log_merge(mlflow, root, name, metrics, example, context)
        rounds = json.loads((root / FEDERATED_METRICS).read_text())
        for name in config["federated"]["algorithms"]:
            log_federated(mlflow, root, name, config, rounds[name], metrics[f"federated/{name}"], context)
    return {
        "run_id": parent.info.run_id,
        "experiment_id": experiment,
        "registered": context["registered"],
        "not_registered": context["not_registered"],
    }
