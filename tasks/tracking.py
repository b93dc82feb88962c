"""MLflow logging of a pipeline's results: a parent run, one child per client and per merge.

The logging step is cached like any other: its key covers the evaluated artifacts, the
params and the tracking URI, so re-running an unchanged pipeline logs nothing twice,
while pointing at a new tracking server logs the results there.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import re
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mergeflow.checkpoints import load_checkpoint, load_checkpoint_meta
from mergeflow.config import Params
from mergeflow.import_graph import third_party_versions
from tasks.align import ALIGN_METRICS, BARRIER_PLOT
from tasks.data import DATA_METRICS, PARTITIONS, PREPARED, client_file
from tasks.evaluation import METRICS, PLOT, SANITY, SELECTION, SELECTION_PLOT
from tasks.federated import FEDERATED_METRICS, FEDERATED_PLOT, final_checkpoint, global_checkpoint
from tasks.merging import merged_checkpoint, merged_pretrained_dir
from tasks.mlflow_store import is_remote, store_exists, tracking_uri
from tasks.steps import Step
from tasks.store import STATE_DIR, hash_paths, sha256_file
from tasks.tracking_params import data_label, flatten, params_in_use, registered_model_name, run_name
from tasks.training import client_checkpoint

PARTITION_METRICS = "metrics/partition.json"
PARTITION_PLOT = "plots/partition.png"
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
_MAX_PARAMS_PER_CALL = 100


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


def plan_track(params: Params) -> list[Step]:
    """One step that logs the whole pipeline's results to MLflow."""
    clients = tuple(client_checkpoint(c) for c in range(params.partition.num_clients))
    merged = tuple(merged_checkpoint(m) for m in params.merge.methods)
    step_params = {
        "params": params.model_dump(mode="json", exclude={"orchestration"}),
        "in_use": params_in_use(params),  # what the pipeline run logs as its params
        "data": data_label(params),
        "uri": os.environ.get("MLFLOW_TRACKING_URI", "local"),
    }
    federated = tuple(final_checkpoint(params, name) for name in params.federated.algorithms)
    inputs = (*_ARTIFACTS, *clients, *merged, *federated)
    # A hit only while the store still holds the logged runs: a pulled clone's or an emptied store is filled.
    # The record of a run logged to a server travels with the data: a clone that logs there too finds it.
    holds, local = "tasks.mlflow_store:holds_logged_run", not is_remote(step_params["uri"])
    return [Step("track", "tasks.tracking:track", step_params, inputs=inputs, holds=holds, local=local)]


def _git_commit(root: Path) -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() or "unknown"


def _digest(hashes: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()[:16]


# Marks an experiment as model training, so that MLflow's UI opens it on its runs, not on the GenAI overview.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def _experiment_id(mlflow, name: str, root: Path) -> str:
    experiment = mlflow.get_experiment_by_name(name)
    if experiment is None:
        location = (root / "mlruns").resolve().as_uri() if "MLFLOW_TRACKING_URI" not in os.environ else None
        return mlflow.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
    for key, value in EXPERIMENT_KIND.items():
        if key not in experiment.tags:  # made by an older mergeflow, or by hand
            mlflow.tracking.MlflowClient().set_experiment_tag(experiment.experiment_id, key, value)
    return experiment.experiment_id


def _log_dataset(mlflow, root: Path, relative: str, info: dict[str, Any], context: str) -> None:
    """A prepared split or partition as an MLflow dataset input (the runs table's "Dataset" column), named
    by its source and file and identified by its content's sha256."""
    from mlflow.data.dataset_source_registry import get_registered_sources

    from tasks.data import read_arrays

    path = root / relative
    X, y = read_arrays(path, info)
    local = next(c for c in get_registered_sources() if c.__name__ == "LocalArtifactDatasetSource")
    name = f"{info['source']}:{Path(relative).stem}"
    source, digest = local(str(path.resolve())), sha256_file(path)[:8]
    dataset = mlflow.data.from_numpy(X, targets=y, source=source, name=name, digest=digest)
    mlflow.log_input(dataset, context=context)


def _log_params(mlflow, params: dict[str, str]) -> None:
    items = list(params.items())
    for start in range(0, len(items), _MAX_PARAMS_PER_CALL):
        mlflow.log_params(dict(items[start : start + _MAX_PARAMS_PER_CALL]))


def _test_metrics(values: dict[str, Any]) -> dict[str, float]:
    """``test_<metric>``, and ``test_<group>_<metric>`` for the per-group metrics of a group column."""
    flat = {f"test_{k}": float(v) for k, v in values.items() if k not in ("client", "by_group")}
    for group, metrics in values.get("by_group", {}).items():
        flat |= {f"test_{_metric_key(group)}_{k}": float(v) for k, v in metrics.items()}
    return flat


def _metric_key(name: str) -> str:
    """A group name as MLflow accepts it in a metric key (letters, digits, ``_-. /``)."""
    return re.sub(r"[^\w\-. /]", "_", str(name))


def _log_curves(mlflow, curves: dict[str, list[float]]) -> None:
    """Step-wise metrics (a loss curve, a solver's residuals) in one batch."""
    from mlflow.entities import Metric

    history = [Metric(name, float(v), 0, step) for name, values in curves.items() for step, v in enumerate(values)]
    if history:
        mlflow.tracking.MlflowClient().log_batch(mlflow.active_run().info.run_id, metrics=history)


def _barrier_metrics(report: dict[str, Any]) -> dict[str, float]:
    """``barrier_before_mean`` (and ``_after``, ``_repaired`` with REPAIR): the mean loss barrier from the reference
    to the other clients. Each client's curve and barrier are in ``metrics/align.json``, an artifact of the run."""
    phases = {phase: report.get(phase, {}) for phase in ("before", "after", "repaired")}
    return {
        f"barrier_{phase}_mean": sum(float(c["barrier"]) for c in curves.values()) / len(curves)
        for phase, curves in phases.items()
        if curves
    }


def step_times(root: Path) -> dict[tuple[str, str], tuple[int, int]]:
    """When the step that made each output ran: ``{(path, sha256): (start, end)}`` in epoch milliseconds,
    from the steps' records (a record without a start time, from an older mergeflow, is left out)."""
    from tasks.steps import results_dir

    times = {}
    for path in results_dir(root).glob("*"):
        try:
            record = json.loads(path.read_text())
            start = int(record["started"] * 1000)
            end = start + int(record["seconds"] * 1000)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        times |= {(name, digest): (start, end) for name, digest in record.get("files", {}).items()}
    return times


def step_devices(root: Path) -> dict[tuple[str, str], dict[str, str]]:
    """What made each output: ``{(path, sha256): {"device", "device_name"[, "precision"]}}`` from the records of
    the steps that computed on a device (the device is not in the cache key: the runs say which made what)."""
    from tasks.steps import results_dir

    devices = {}
    for path in results_dir(root).glob("*"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or "device" not in record:
            continue
        facts = {key: str(record[key]) for key in ("device", "device_name", "precision") if key in record}
        devices |= {(name, digest): facts for name, digest in record.get("files", {}).items()}
    return devices


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


def _log_client(mlflow, root: Path, client: int, metrics: dict[str, Any], context: dict[str, Any]) -> None:
    info = context["info"]
    _, meta = load_checkpoint(root / client_checkpoint(client))
    tags = {"mergeflow.kind": "client", "mergeflow.diverged": str(bool(meta.get("diverged"))).lower()}
    tags |= context["data_tags"] | _device_tags(root, context, client_checkpoint(client))
    name = f"client_{client:03d}"
    with _child_run(mlflow, name, tags, _made_when(root, context, client_checkpoint(client))):
        mlflow.set_tag("mergeflow.client", str(client))
        _log_dataset(mlflow, root, client_file(client), info, "training")
        _log_params(mlflow, {**flatten(meta["train"]), "num_examples": str(meta["num_examples"])})
        _log_curves(mlflow, {"train_loss": meta["step_losses"]})
        mlflow.log_metrics(_test_metrics(metrics[f"client_{client:03d}"]))


def _log_selection(mlflow, selection: dict[str, Any]) -> None:
    """A searched merge: each candidate's validation scores as ``val_<metric>`` at step = candidate index,
    the chosen values as ``selected.<option>`` params, and the tag ``mergeflow.selected_on``."""
    curves: dict[str, list[float]] = {}
    for candidate in selection["candidates"]:
        for metric, value in candidate["validation"].items():
            curves.setdefault(f"val_{metric}", []).append(float(value))
    _log_curves(mlflow, curves)
    chosen = selection["candidates"][selection["chosen"]]
    _log_params(mlflow, {f"selected.{key}": json.dumps(chosen["options"][key]) for key in selection["searched"]})
    mlflow.set_tags({"mergeflow.selected_on": selection["split"], "mergeflow.select_by": selection["select_by"]})


def _register(mlflow, model_uri: str, name: str, tags: dict[str, str]) -> tuple[str | None, str | None]:
    """A new version of ``name`` unless a version already holds the same checkpoint (by sha256); says which.

    The logging step re-runs as a whole when any merge changed; this keeps the unchanged
    merges from gaining identical versions. MLflow's own two lines per version, printed straight to
    stderr, are kept off the console: the run's summary names the new versions instead. A model whose
    signature differs from the name's versions' (tag ``mergeflow.signature``) is not registered: the
    second value says why, for the summary.
    """
    client = mlflow.tracking.MlflowClient()
    digest = tags["mergeflow.checkpoint_sha256"]
    versions = client.search_model_versions(f"name='{name}'")
    if any(v.tags.get("mergeflow.checkpoint_sha256") == digest for v in versions):
        return None, None
    signatures = {v.tags["mergeflow.signature"] for v in versions if "mergeflow.signature" in v.tags}
    if signatures - {tags["mergeflow.signature"]}:
        return None, f"{name}: its versions take other inputs (set tracking.experiment to keep both)"
    with contextlib.redirect_stderr(io.StringIO()):
        version = mlflow.register_model(model_uri, name, tags=tags)
    return f"{name} version {version.version}", None


def _log_merge(mlflow, root: Path, name: str, metrics: dict[str, Any], example, context: dict[str, Any]) -> None:
    import mlflow.pytorch

    path = root / merged_checkpoint(name)
    _, meta = load_checkpoint(path)
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
        _log_dataset(mlflow, root, f"{PREPARED}/test.parquet", context["info"], "evaluation")
        if "selection" in meta:
            _log_dataset(mlflow, root, f"{PREPARED}/validation.parquet", context["info"], "validation")
        excluded = ",".join(str(c) for c in meta.get("excluded_clients", [])) or "none"
        options = flatten(meta["options"], "option.")
        _log_params(mlflow, {"method": meta["method"], "excluded_clients": excluded, **options})
        mlflow.log_metrics({**_test_metrics(metrics[f"merged/{name}"]), **meta.get("summary", {})})
        _log_curves(mlflow, meta.get("curves", {}))
        if "selection" in meta:
            _log_selection(mlflow, meta["selection"])
        earlier = _earlier_merge_run(mlflow, run, name, digest)
        if earlier is None:
            mlflow.log_artifact(str(path), "checkpoint")
        else:  # the same merged weights as an earlier run (a cached step): point to its copy, log none again
            mlflow.set_tag("mergeflow.reused_from_run", earlier)
        if context["log_models"]:
            model_uri = _logged_model_uri(mlflow, run.info.experiment_id, name, digest)
            if model_uri is None:
                model_uri = _log_model(mlflow, root, name, path, example, tags).model_uri
            mlflow.set_tag("mergeflow.model_uri", model_uri)
            version_tags = {
                "mergeflow.data_hash": context["data_hash"],
                "mergeflow.params_hash": context["params_hash"],
                "mergeflow.checkpoint_sha256": digest,
                "mergeflow.method": meta["method"],
                "mergeflow.run_id": run.info.run_id,
                "mergeflow.signature": _signature_digest(mlflow, model_uri),
                **context["data_tags"],
            }
            registered_name = registered_model_name(context["experiment"], context["data_tags"]["mergeflow.data"], name)
            registered, refused = _register(mlflow, model_uri, registered_name, version_tags)
            context["registered"] += [registered] if registered else []
            context["not_registered"] += [refused] if refused else []


def _signature_digest(mlflow, model_uri: str) -> str:
    """A digest of a logged model's signature (its inputs and outputs; ``none`` for a model logged without one)."""
    signature = mlflow.models.get_model_info(model_uri).signature
    text = json.dumps(signature.to_dict() if signature is not None else None, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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


def _logged_model_uri(mlflow, experiment_id: str, name: str, digest: str) -> str | None:
    """The URI of the model this experiment already logged for merge ``name`` from the checkpoint ``digest``, in
    full (a logging that a kill stopped half-way leaves a model that is not READY: it is logged again)."""
    from mlflow.entities import LoggedModelStatus

    logged = mlflow.search_logged_models(experiment_ids=[experiment_id], output_format="list")
    same = [m for m in logged if m.name == name and m.tags.get("mergeflow.checkpoint_sha256") == digest]
    ready = [m for m in same if m.status == LoggedModelStatus.READY]
    return ready[0].model_uri if ready else None


def _log_model(mlflow, root: Path, name: str, path: Path, example, tags: dict[str, str]):
    """Log a merged model in its family's flavour (:data:`FLAVOURS`), named after its merge, with ``tags``."""
    import torch

    from mergeflow.schema.families import family_of_arch

    requirements = [f"torch=={torch.__version__.split('+')[0]}"]
    flavour = family_of_arch(load_checkpoint_meta(path)["spec"]["arch"]).flavour
    return FLAVOURS[flavour](mlflow, root, name, path, example, requirements, tags)


def _log_pipeline(mlflow, root: Path, name: str, path: Path, example, requirements: list[str], tags: dict[str, str]):
    """A transformer as a text-classification or text-generation pipeline (text in, labels or text out),
    from the directory its family exported beside the checkpoint."""
    import mlflow.transformers
    import transformers

    directory = root / merged_pretrained_dir(name)
    config = transformers.AutoConfig.from_pretrained(directory)
    generates = any(arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel") for arch in config.architectures or [])
    auto = transformers.AutoModelForCausalLM if generates else transformers.AutoModelForSequenceClassification
    model = auto.from_pretrained(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    task = "text-generation" if generates else "text-classification"
    pipe = transformers.pipeline(task, model=model, tokenizer=tokenizer, truncation=True)
    # Explicit requirements: the flavour would otherwise infer torchvision, which offline installs lack.
    requirements.append(f"transformers=={transformers.__version__}")
    return mlflow.transformers.log_model(transformers_model=pipe, name=name, pip_requirements=requirements, tags=tags)


def _log_raw_rows_model(
    mlflow, root: Path, name: str, path: Path, example, requirements: list[str], tags: dict[str, str]
):
    """A pyfunc model that takes the user's raw rows: the feature encoding fitted on the training split
    (standardisation, one-hot categories, filled gaps) travels with the checkpoint, and mergeflow's code
    with the model, so ``mlflow.pyfunc.load_model(uri).predict(rows)`` works wherever torch is installed."""
    import mlflow.pyfunc
    import pandas
    import pyarrow

    from tasks.serving import CHECKPOINT, INFO
    from tasks.steps import project_root_of_code

    code = project_root_of_code()
    requirements += [f"pandas=={pandas.__version__}", f"pyarrow=={pyarrow.__version__}"]
    info_file = root / PREPARED / "info.json"
    return mlflow.pyfunc.log_model(
        name=name,
        tags=tags,
        python_model=str(code / "tasks" / "pyfunc_model.py"),
        artifacts={CHECKPOINT: str(path), INFO: str(info_file)},
        code_paths=[str(code / "mergeflow"), str(code / "tasks")],
        input_example=example,
        signature=_raw_rows_signature(path, info_file, example),
        pip_requirements=requirements,
    )


def _raw_rows_signature(path: Path, info_file: Path, example):
    """The model's signature: the columns it answers with, and the raw columns it takes (doubles for numbers,
    so whole numbers and gaps pass). Built-in sources take arrays of any float type: no input schema, since
    MLflow's tensor specs would refuse every dtype but one."""
    import pandas
    from mlflow.models import infer_signature

    from mergeflow.predictor import TablePredictor

    outputs = TablePredictor.from_files(path, info_file).predict(example)
    with warnings.catch_warnings():  # its hint on integer columns concerns inputs; a label column has no gaps
        warnings.filterwarnings("ignore", message=".*Inferred schema contains integer column")
        return infer_signature(example if isinstance(example, pandas.DataFrame) else None, outputs)


FLAVOURS = {"transformers": _log_pipeline, "pyfunc": _log_raw_rows_model}  # by a family's declared flavour


def _log_federated(
    mlflow, root: Path, name: str, config: dict[str, Any], rounds: list[dict], final: dict, context: dict[str, Any]
) -> None:
    """A child run per federated algorithm: its options and its global model's metrics per round (step=round),
    the splits it trained on and was scored on, spanning its rounds' steps (from its first to its last)."""
    algorithm = config["federated"]["options"].get(name, {}).get("algorithm", name)
    final_checkpoint = global_checkpoint(name, len(rounds) - 1)
    tags = {
        "mergeflow.kind": "federated",
        "mergeflow.algorithm": algorithm,
        "mergeflow.federated": name,
        "mergeflow.checkpoint_sha256": sha256_file(root / final_checkpoint),
        **context["data_tags"],
    }
    if rounds[0].get("warning"):
        tags["mergeflow.warning"] = rounds[0]["warning"]
    first, last = (_made_when(root, context, global_checkpoint(name, r)) for r in (0, len(rounds) - 1))
    times = (first[0], last[1]) if first and last else None
    with _child_run(mlflow, f"federated_{name}", tags, times):
        for split in ("train", "test"):
            if (root / PREPARED / f"{split}.parquet").is_file():
                _log_dataset(mlflow, root, f"{PREPARED}/{split}.parquet", context["info"], _SPLIT_CONTEXTS[split])
        options = {k: v for k, v in config["federated"]["options"].get(name, {}).items() if k != "algorithm"}
        server_side = {k: config["federated"].get(k) for k in ("server", "aggregator", "attack", "dp")}
        server_side = {k: v for k, v in server_side.items() if v is not None and k not in options}
        _log_params(mlflow, {"algorithm": algorithm, **flatten(options, "option."), **flatten(server_side, "server.")})
        mlflow.log_metrics(_test_metrics(final))
        _log_rounds(mlflow, rounds)


ROUND_METRICS = (
    *("accuracy", "nll", "ece", "mse", "drift", "train_loss", "bma_accuracy", "bma_nll", "bma_ece"),
    # Server-side: what the aggregator kept of the attackers' messages, DP's spent ε and its clip.
    *("attacked_kept", "epsilon", "epsilon_round", "clip"),
)


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


def track(params: dict[str, Any], root: Path, out: Path) -> dict[str, Any]:
    """Log the parent pipeline run and its client, merge and federated child runs."""
    with _tracking_lock(root):
        return _track(params, root)


def _input_example(root: Path, info: dict[str, Any]):
    """Two raw rows as a logged model takes them: a DataFrame of the source's columns, or an array of
    features (a built-in source's, or token ids for text)."""
    import numpy as np
    import pandas as pd

    from tasks.data import read_arrays

    raw = info.get("raw_example")
    if raw is None or list(raw) == ["x"]:
        features = read_arrays(root / PREPARED / "test.parquet", info)[0][:2]
        return features.reshape(len(features), -1).astype(np.float64)
    frame = pd.DataFrame(raw)
    numbers = frame.select_dtypes("number").columns  # as doubles, so that whole-number columns also take 1.5 or NaN
    return frame.astype({column: np.float64 for column in numbers})


_SPLIT_CONTEXTS = {"train": "training", "server": "pretraining", "validation": "validation", "test": "evaluation"}


def _log_data(mlflow, root: Path, info: dict[str, Any], sanity: dict[str, Any]) -> None:
    """The prepared splits as dataset inputs, the feature encoding's choices, and the input-blind baseline
    (with the run's warning as the ``mergeflow.warning`` tag when the models did not beat it)."""
    for split, context in _SPLIT_CONTEXTS.items():
        if (root / PREPARED / f"{split}.parquet").is_file():
            _log_dataset(mlflow, root, f"{PREPARED}/{split}.parquet", info, context)
    report = json.loads((root / DATA_METRICS).read_text())
    mlflow.log_params({STANDARDIZED: str(report["standardized"]).lower()})
    if "standardize_reason" in report:
        mlflow.set_tag("mergeflow.standardize_reason", report["standardize_reason"])
    baseline = {k: v for k, v in sanity.items() if k in ("baseline_accuracy", "baseline_mse")}
    mlflow.log_metrics({f"baseline.test_{k.removeprefix('baseline_')}": float(v) for k, v in baseline.items()})
    if sanity["warning"]:
        mlflow.set_tag("mergeflow.warning", sanity["warning"])


STANDARDIZED = "data.standardized"  # a param the data step chose, logged beside the params in use


def _previous_params(mlflow, experiment_id: str, data: str) -> dict[str, str] | None:
    """The params in use of the experiment's latest finished pipeline run on the data named ``data``; None for
    none."""
    found = mlflow.search_runs(
        experiment_ids=[experiment_id],
        filter_string=f"tags.`mergeflow.kind` = 'pipeline' and tags.`mergeflow.data` = '{data}' and "
        "attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
        output_format="list",
    )
    return {k: v for k, v in found[0].data.params.items() if k != STANDARDIZED} if found else None


def run_started(root: Path) -> int | None:
    """When the pipeline run that holds the workspace lock started (epoch ms), as the lock file says; None
    when it does not say (a lock taken by an older mergeflow)."""
    try:
        return int(json.loads((root / STATE_DIR / "pipeline.lock").read_text())["started"] * 1000)
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def _pipeline_run(mlflow, experiment_id: str, name: str, tags: dict[str, str], started: int | None) -> Iterator[Any]:
    """The parent run, from when the pipeline run started (``started``, epoch ms) to the end of its logging."""
    created = mlflow.tracking.MlflowClient().create_run(experiment_id, start_time=started, tags=tags, run_name=name)
    with mlflow.start_run(run_id=created.info.run_id) as run:
        yield run


def _track(params: dict[str, Any], root: Path) -> dict[str, Any]:
    import mlflow

    from tasks.data import read_info

    config = params["params"]
    mlflow.set_tracking_uri(tracking_uri(root))
    experiment_id = _experiment_id(mlflow, config["tracking"]["experiment"], root)
    mlflow.set_experiment(experiment_id=experiment_id)  # nested child runs follow the active experiment
    metrics = json.loads((root / METRICS).read_text())
    info = read_info(root)
    example = _input_example(root, info)
    # Which data: its name, and the test split's digest (models scored on the same split compare: `best`).
    test_split = sha256_file(root / PREPARED / "test.parquet")[:16]
    data_tags = {"mergeflow.data": params["data"], "mergeflow.test_data": test_split}
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
    named = run_name(params["data"], logged, _previous_params(mlflow, experiment_id, params["data"]))
    with _pipeline_run(mlflow, experiment_id, named, tags, run_started(root)) as parent:
        _log_params(mlflow, logged)
        for name in ("base", "centralized", "ensemble", "best_client"):
            if name not in metrics:  # a causal LM has no output ensemble
                continue
            mlflow.log_metrics({f"{name}.{k}": v for k, v in _test_metrics(metrics[name]).items()})
        for artifact in _ARTIFACTS:
            mlflow.log_artifact(str(root / artifact), Path(artifact).parent.name)
        if json.loads((root / SELECTION).read_text()):
            mlflow.log_artifact(str(root / SELECTION_PLOT), "plots")
        mlflow.log_metrics(_barrier_metrics(json.loads((root / ALIGN_METRICS).read_text())))
        _log_data(mlflow, root, info, metrics[SANITY])
        context = {
            "experiment": config["tracking"]["experiment"],
            "log_models": config["tracking"]["log_models"],
            "data_hash": tags["mergeflow.data_hash"],
            "data_tags": data_tags,
            "params_hash": tags["mergeflow.params_hash"],
            "info": info,
            "times": step_times(root),
            "registered": [],
            "not_registered": [],
            "devices": step_devices(root),
        }
        made_on = sorted({facts.get("device_name", facts["device"]) for facts in context["devices"].values()})
        if made_on:  # the devices this run's models were made on (several: a run that reused other devices' steps)
            mlflow.set_tag("mergeflow.devices", ", ".join(made_on))
        for client in range(config["partition"]["num_clients"]):
            _log_client(mlflow, root, client, metrics, context)
        for name in config["merge"]["methods"]:
            _log_merge(mlflow, root, name, metrics, example, context)
        rounds = json.loads((root / FEDERATED_METRICS).read_text())
        for name in config["federated"]["algorithms"]:
            _log_federated(mlflow, root, name, config, rounds[name], metrics[f"federated/{name}"], context)
    return {
        "run_id": parent.info.run_id,
        "experiment_id": experiment_id,
        "registered": context["registered"],
        "not_registered": context["not_registered"],
    }


def log_reproduction(
    root: Path, name: str, settings: dict[str, Any], table: dict[str, dict], curves: dict[str, list[float]]
) -> str:
    """One MLflow run (tag ``mergeflow.kind=reproduction``) with a results table and step curves."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(root))
    experiment_id = _experiment_id(mlflow, "reproductions", root)
    tags = {"mergeflow.kind": "reproduction", "mergeflow.reproduction": name}
    with mlflow.start_run(experiment_id=experiment_id, run_name=name, tags=tags) as run:
        _log_params(mlflow, flatten(settings))
        scalars = {
            f"{row}.{metric}".replace(" ", "_").replace("%", "pct").replace("(", "").replace(")", ""): float(value)
            for row, values in table.items()
            for metric, value in values.items()
        }
        mlflow.log_metrics(scalars)
        safe = {key.replace(" ", "_").replace("%", "pct"): values for key, values in curves.items()}
        _log_curves(mlflow, safe)
        mlflow.log_dict(table, "results.json")
    return run.info.run_id
