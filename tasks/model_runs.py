"""The child runs of a pipeline's MLflow run: one per client, merge and federated algorithm, each with the data
it trained on or was scored on, its params and metrics, spanning the step that made what it logs.

``context`` is the pipeline run's (:func:`tasks.tracking.track`): its data tags and split info, the steps'
times and devices (:mod:`tasks.provenance`), and the registry versions made so far."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mergeflow.checkpoints import load_checkpoint_meta
from mergeflow.task_scores import is_summary
from tasks.layout import PREPARED, TaskPaths, client_checkpoint, client_file, merged_checkpoint
from tasks.mlflow_flavours import log_model, logged_model_uri
from tasks.mlflow_logging import flatten, log_batch, log_curves, log_params
from tasks.model_registry import register, registered_model_name, signature_digest
from tasks.store import sha256_file

# The MLflow dataset context of each prepared split.
SPLIT_CONTEXTS = {"train": "training", "server": "pretraining", "validation": "validation", "test": "evaluation"}
ROUND_METRICS = (
    *("accuracy", "nll", "ece", "mse", "drift", "train_loss", "bma_accuracy", "bma_nll", "bma_ece"),
    # Server-side: what the aggregator kept of the attackers' messages, DP's spent ε and its clip.
    *("attacked_kept", "epsilon", "epsilon_round", "clip"),
)


def log_dataset(mlflow, root: Path, relative: str, info: dict[str, Any], context: str) -> None:
    """A prepared split or partition as an MLflow dataset input (the runs table's "Dataset" column), named
    by its source and file and identified by its content's sha256."""
    from mlflow.data.dataset_source_registry import get_registered_sources

    from tasks.prepared import read_arrays

    path = root / relative
    X, y = read_arrays(path, info)
    local = next(c for c in get_registered_sources() if c.__name__ == "LocalArtifactDatasetSource")
    name = f"{info['source']}:{Path(relative).stem}"
    source, digest = local(str(path.resolve())), sha256_file(path)[:8]
    dataset = mlflow.data.from_numpy(X, targets=y, source=source, name=name, digest=digest)
    mlflow.log_input(dataset, context=context)


def test_metrics(values: dict[str, Any]) -> dict[str, float]:
    """``test_<metric>``, and ``test_<group>_<metric>`` for the per-group metrics of a group column.

    A model's row of a multi-task run (:mod:`mergeflow.task_scores`): its averages over tasks as
    ``test_avg_<metric>`` (the headline: ``test_avg_normalized_accuracy``), each task's metrics as
    ``<task>.test_<metric>`` (``low.test_accuracy``, ``low.test_normalized_accuracy``).
    """
    if is_summary(values):
        flat = {f"test_{k}": float(v) for k, v in values.items() if k.startswith("avg_")}
        for task, metrics in values["tasks"].items():
            flat |= {f"{task}.{k}": v for k, v in test_metrics(metrics).items()}
        return flat
    flat = {f"test_{k}": float(v) for k, v in values.items() if k not in ("client", "by_group")}
    for group, metrics in values.get("by_group", {}).items():
        flat |= {f"test_{_metric_key(group)}_{k}": float(v) for k, v in metrics.items()}
    return flat


def _metric_key(name: str) -> str:
    """A group name as MLflow accepts it in a metric key (letters, digits, ``_-. /``)."""
    return re.sub(r"[^\w\-. /]", "_", str(name))


def _device_tags(root: Path, context: dict[str, Any], relative: str) -> dict[str, str]:
    """``mergeflow.device``, ``mergeflow.device_name`` (and ``mergeflow.precision``) of the step that made
    ``relative`` as it is now; none when no record says."""
    facts = context["devices"].get((relative, sha256_file(root / relative)), {})
    return {f"mergeflow.{key}": value for key, value in facts.items()}


@contextlib.contextmanager
def _child_run(mlflow, name: str, tags: dict[str, str], times: tuple[int, int] | None) -> Iterator[Any]:
    """A nested run; with ``times``, it spans the step that made what it logs, not the logging."""
    if times is None:
        with mlflow.start_run(run_name=name, nested=True, tags=tags) as run:
            yield run
        return
    client = mlflow.tracking.MlflowClient()
    parent = mlflow.active_run()
    created = client.create_run(
        parent.info.experiment_id,
        start_time=times[0],
        tags={**tags, "mlflow.parentRunId": parent.info.run_id},
        run_name=name,
    )
    with mlflow.start_run(run_id=created.info.run_id, nested=True) as run:
        yield run
    client.set_terminated(created.info.run_id, end_time=times[1])


def _made_when(root: Path, context: dict[str, Any], relative: str) -> tuple[int, int] | None:
    """The start and end of the step that made the output ``relative`` as it is now."""
    return context["times"].get((relative, sha256_file(root / relative)))


def log_client(mlflow, root: Path, client: int, metrics: dict[str, Any], context: dict[str, Any]) -> None:
    """A client's run: its partition, training settings, loss curve and test metrics; for a client given instead of
    trained, where it came from (``given.source``, ``given.kind``, ``given.sha256``) instead of its training."""
    meta = load_checkpoint_meta(root / client_checkpoint(client))
    info = context["infos"][meta.get("task")]  # its task's data (a multi-task run's)
    tags = {"mergeflow.kind": "client", "mergeflow.diverged": str(bool(meta.get("diverged"))).lower()}
    tags |= context["data_tags"] | _device_tags(root, context, client_checkpoint(client))
    tags["mergeflow.client"] = str(client)
    name = f"client_{client:03d}"
    with _child_run(mlflow, name, tags, _made_when(root, context, client_checkpoint(client))):
        log_dataset(mlflow, root, client_file(client), info, "training")
        log_batch(
            mlflow,
            params={**client_params(meta), "num_examples": str(meta["num_examples"])},
            metrics=test_metrics(metrics[f"client_{client:03d}"]),
            curves={"train_loss": meta.get("step_losses", [])},
        )


def client_params(meta: dict[str, Any]) -> dict[str, str]:
    """A client's training settings (flat), or for a client given instead of trained where it came from."""
    given = meta.get("given")
    return flatten(meta["train"]) if given is None else given_params(given)


def given_params(given: dict[str, Any]) -> dict[str, str]:
    """Where a given client came from, as run params: its source, kind, and its files' sha256 (one digest for a
    single file, else ``file=digest`` pairs by file name)."""
    files = given["files"]
    digests = [f"{Path(file).name}={digest}" for file, digest in files.items()]
    sha256 = next(iter(files.values())) if len(files) == 1 else ",".join(digests)
    return {"given.source": given["source"], "given.kind": given["kind"], "given.sha256": sha256}


def _log_selection(mlflow, selection: dict[str, Any]) -> None:
    """A searched merge: each candidate's validation scores as ``val_<metric>`` at step = candidate index,
    the chosen values as ``selected.<option>`` params, and the tag ``mergeflow.selected_on``."""
    curves: dict[str, list[float]] = {}
    for candidate in selection["candidates"]:
        for metric, value in candidate["validation"].items():
            curves.setdefault(f"val_{metric}", []).append(float(value))
    log_curves(mlflow, curves)
    chosen = selection["candidates"][selection["chosen"]]
    log_params(mlflow, {f"selected.{key}": json.dumps(chosen["options"][key]) for key in selection["searched"]})
    mlflow.set_tags({"mergeflow.selected_on": selection["split"], "mergeflow.select_by": selection["select_by"]})


def log_merge(mlflow, root: Path, name: str, metrics: dict[str, Any], example, context: dict[str, Any]) -> None:
    """A merge's run: its options, metrics, curves and checkpoint (once per experiment), and with
    ``tracking.log_models`` its logged model and Model Registry version. A multi-task run's merge has a
    checkpoint per task (the merged body with each task's head), logged as artifacts under ``checkpoint/<task>``."""
    tasks = list(context["infos"])
    if tasks != [None]:
        _log_task_merge(mlflow, root, name, metrics, context, tasks)
        return
    path = root / merged_checkpoint(name)
    meta = load_checkpoint_meta(path)
    digest = sha256_file(path)
    tags = {
        "mergeflow.kind": "merge",
        "mergeflow.method": meta["method"],
        "mergeflow.merge": name,
        "mergeflow.checkpoint_sha256": digest,
    }
    tags |= context["data_tags"] | _device_tags(root, context, merged_checkpoint(name))
    with _child_run(mlflow, f"merge_{name}", tags, _made_when(root, context, merged_checkpoint(name))) as run:
        # What it was scored on (test), and what chose its settings (validation, for a searched merge).
        log_dataset(mlflow, root, f"{PREPARED}/test.parquet", context["info"], "evaluation")
        if "selection" in meta:
            log_dataset(mlflow, root, f"{PREPARED}/validation.parquet", context["info"], "validation")
        excluded = ",".join(str(c) for c in meta.get("excluded_clients", [])) or "none"
        options = flatten(meta["options"], "option.")
        log_params(mlflow, {"method": meta["method"], "excluded_clients": excluded, **options})
        mlflow.log_metrics({**test_metrics(metrics[f"merged/{name}"]), **meta.get("summary", {})})
        log_curves(mlflow, meta.get("curves", {}))
        if "selection" in meta:
            _log_selection(mlflow, meta["selection"])
        earlier = _earlier_merge_run(mlflow, run, name, digest)
        if earlier is None:
            mlflow.log_artifact(str(path), "checkpoint")
        else:  # the same merged weights as an earlier run (a cached step): point to its copy, log none again
            mlflow.set_tag("mergeflow.reused_from_run", earlier)
        if context["log_models"]:
            model_uri = logged_model_uri(mlflow, run.info.experiment_id, name, digest)
            if model_uri is None:
                model_uri = log_model(mlflow, root, name, path, example, tags).model_uri
            mlflow.set_tag("mergeflow.model_uri", model_uri)
            version_tags = {
                "mergeflow.data_hash": context["data_hash"],
                "mergeflow.params_hash": context["params_hash"],
                "mergeflow.checkpoint_sha256": digest,
                "mergeflow.method": meta["method"],
                "mergeflow.run_id": run.info.run_id,
                "mergeflow.signature": signature_digest(mlflow, model_uri),
                **context["data_tags"],
            }
            registered_name = registered_model_name(context["experiment"], context["data_tags"]["mergeflow.data"], name)
            registered, refused = register(mlflow, model_uri, registered_name, version_tags)
            context["registered"] += [registered] if registered else []
            context["not_registered"] += [refused] if refused else []


def _log_task_merge(
    mlflow, root: Path, name: str, metrics: dict[str, Any], context: dict[str, Any], tasks: list[str]
) -> None:
    """A multi-task merge's run: its options, per-task and average metrics, curves, each task's test (and, for a
    search, validation) split and each task's checkpoint. Its models are not logged as MLflow models: each
    task's model is the merged body with that task's head, and the pyfunc flavour serves one model."""
    paths = [TaskPaths(task).merged_checkpoint(name) for task in tasks]
    meta = load_checkpoint_meta(root / paths[0])
    digest = _digest(root, paths)
    tags = {"mergeflow.kind": "merge", "mergeflow.method": meta["method"], "mergeflow.merge": name}
    tags |= {"mergeflow.checkpoint_sha256": digest} | context["data_tags"]
    tags |= _device_tags(root, context, paths[0])
    with _child_run(mlflow, f"merge_{name}", tags, _made_when(root, context, paths[0])) as run:
        for task in tasks:
            prepared, info = TaskPaths(task).prepared, context["infos"][task]
            log_dataset(mlflow, root, f"{prepared}/test.parquet", info, "evaluation")
            if "selection" in meta:
                log_dataset(mlflow, root, f"{prepared}/validation.parquet", info, "validation")
        excluded = ",".join(str(c) for c in meta.get("excluded_clients", [])) or "none"
        log_params(
            mlflow, {"method": meta["method"], "excluded_clients": excluded, **flatten(meta["options"], "option.")}
        )
        mlflow.log_metrics({**test_metrics(metrics[f"merged/{name}"]), **meta.get("summary", {})})
        log_curves(mlflow, meta.get("curves", {}))
        if "selection" in meta:
            _log_selection(mlflow, meta["selection"])
        earlier = _earlier_merge_run(mlflow, run, name, digest)
        if earlier is not None:  # the same merged weights as an earlier run (a cached step): point to its copy
            mlflow.set_tag("mergeflow.reused_from_run", earlier)
            return
        for task, path in zip(tasks, paths, strict=True):
            mlflow.log_artifact(str(root / path), f"checkpoint/{task}")


def _digest(root: Path, paths: list[str]) -> str:
    """The sha256 of a checkpoint, or of a multi-task model's checkpoints (one per task) together."""
    digests = [sha256_file(root / path) for path in paths]
    return digests[0] if len(digests) == 1 else hashlib.sha256("".join(digests).encode()).hexdigest()


def _earlier_merge_run(mlflow, run, name: str, digest: str) -> str | None:
    """The id of the first earlier run of merge ``name`` in this experiment that logged the checkpoint ``digest``."""
    found = mlflow.search_runs(
        experiment_ids=[run.info.experiment_id],
        filter_string=f"tags.`mergeflow.checkpoint_sha256` = '{digest}' and tags.`mergeflow.merge` = '{name}'",
        order_by=["attributes.start_time ASC"],
        output_format="list",
    )
    first = [r for r in found if r.info.run_id != run.info.run_id and "mergeflow.reused_from_run" not in r.data.tags]
    return first[0].info.run_id if first else None


def log_federated(
    mlflow, root: Path, name: str, config: dict[str, Any], rounds: list[dict], final: dict, context: dict[str, Any]
) -> None:
    """A child run per federated algorithm: its options and its global model's metrics per round (step=round),
    the splits it trained on and was scored on, spanning its rounds' steps (from its first to its last)."""
    algorithm = config["federated"]["options"].get(name, {}).get("algorithm", name)
    tasks, last_round = list(context["infos"]), len(rounds) - 1
    tags = {
        "mergeflow.kind": "federated",
        "mergeflow.algorithm": algorithm,
        "mergeflow.federated": name,
        "mergeflow.checkpoint_sha256": _digest(root, [TaskPaths(t).global_checkpoint(name, last_round) for t in tasks]),
        **context["data_tags"],
    }
    if rounds[0].get("warning"):
        tags["mergeflow.warning"] = rounds[0]["warning"]
    paths = TaskPaths(tasks[0])
    first, last = (_made_when(root, context, paths.global_checkpoint(name, r)) for r in (0, last_round))
    times = (first[0], last[1]) if first and last else None
    with _child_run(mlflow, f"federated_{name}", tags, times):
        for task in tasks:
            prepared = TaskPaths(task).prepared
            for split in ("train", "test"):
                if (root / prepared / f"{split}.parquet").is_file():
                    info = context["infos"][task]
                    log_dataset(mlflow, root, f"{prepared}/{split}.parquet", info, SPLIT_CONTEXTS[split])
        options = {k: v for k, v in config["federated"]["options"].get(name, {}).items() if k != "algorithm"}
        server_side = {k: config["federated"].get(k) for k in ("server", "aggregator", "attack", "dp")}
        server_side = {k: v for k, v in server_side.items() if v is not None and k not in options}
        log_params(mlflow, {"algorithm": algorithm, **flatten(options, "option."), **flatten(server_side, "server.")})
        mlflow.log_metrics(test_metrics(final))
        _log_rounds(mlflow, rounds)


def _log_rounds(mlflow, rounds: list[dict]) -> None:
    """Each round's metrics with ``step`` = the round (round 0 is the starting model)."""
    from mlflow.entities import Metric

    history = [
        Metric(f"round_{key}", float(row[key]), 0, int(row["round"]))
        for row in rounds
        for key in ROUND_METRICS
        if key in row
    ]
    diverged = [Metric("round_diverged_clients", float(len(r["diverged"])), 0, int(r["round"])) for r in rounds[1:]]
    history += diverged
    mlflow.tracking.MlflowClient().log_batch(mlflow.active_run().info.run_id, metrics=history)
