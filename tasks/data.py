"""Steps of the ``prepare`` and ``partition`` stages."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np

from mergeflow.config import Params
from mergeflow.data.encode import encode_splits
from mergeflow.data.partition import (
    combine_partition_stats,
    partition_dataset,
    partition_stats,
    plot_partition_stats,
)
from mergeflow.data.relabel import relabel_dataset, relabel_raw
from mergeflow.data.rows import make_text_dataset
from mergeflow.data.split import split_dataset
from mergeflow.data.storage import load_dataset_file, save_dataset, to_arrays
from mergeflow.data.tokenize import (
    check_vocabulary,
    encode_dataset,
    load_tokenizer,
    tokenizer_facts,
    train_tokenizer,
    training_texts,
)
from mergeflow.files import write_json
from mergeflow.schema.sources import get_source
from tasks.checks import local_data_files
from tasks.layout import (
    CORPUS,
    DATA_METRICS,
    PARTITION_METRICS,
    PARTITION_PLOT,
    TOKENIZER,
    TaskPaths,
    client_file,
)
from tasks.prepared import read_info
from tasks.steps import Step

_REPORT = "report.json"  # a task's data or partition report, beside its files (multi-task runs)


def plan_prepare(params: Params) -> list[Step]:
    """One step per task (one in a single-task run): build the dataset and its splits (keyed also by the content
    of local data files, and by the chosen source's modules only: another source's code or a new source re-keys
    nothing)."""
    return [_prepare_step(params, task) for task in params.task_names]


def _prepare_step(params: Params, task: str | None) -> Step:
    data = params.task_data(task)
    step_params: dict[str, Any] = {"seed": params.seed, "data": data.for_prepare()}
    if task is not None:
        step_params |= {"task": task, "labels": params.tasks[task].labels}
    return Step(
        _named("prepare", task),
        "tasks.data:prepare",
        step_params,
        inputs=local_data_files(params, data),
        members=data.declaration.modules,
    )


def _named(step: str, task: str | None) -> str:
    """A step's name: its own in a single-task run, ``<step>/<task>`` for one task of several."""
    return step if task is None else f"{step}/{task}"


def prepare(params: dict[str, Any], root: Path, out: Path, _settings: dict[str, Any]) -> dict[str, Any]:
    """Load the source, split it (stratified, seeded), encode numeric features with a transform fitted on
    the training split (one-hot categories, filled gaps, standardisation), save parquet files.

    Text sources are saved as text under ``data/prepared/text``, for the tokenize step.
    """
    data, paths = params["data"], TaskPaths(params.get("task"))
    labels = {int(k): v for k, v in params["labels"].items()} if params.get("labels") else None
    source = get_source(data["source"])
    options, loader = source.parse(data[source.name]), source.loader
    fractions = {key: data[key] for key in ("test_fraction", "server_fraction", "validation_fraction")}
    if source.modality(options) == "tokens":
        dataset, info = loader.load(options, seed=params["seed"], data=data)
        if labels:
            dataset, info = relabel_dataset(dataset, info, labels)
        splits = split_dataset(dataset, info, **fractions, seed=params["seed"])
        corpus = loader.corpus(options, seed=params["seed"])
        if corpus:  # unlabelled (y = -1): read only by the tokenizer and language-model pre-training
            splits[CORPUS] = make_text_dataset(corpus, np.full(len(corpus), -1, dtype=np.int64))
        directory = out / paths.text
        report = {"source": info["source"], "standardized": False, "tokenized": True}
    else:
        policies = {"missing": data["missing"], "categorical": data["categorical"]}
        raw = loader.load_raw(options, seed=params["seed"], data=data)
        if labels:
            raw = relabel_raw(raw, labels)
        splits, info = encode_splits(raw, **fractions, seed=params["seed"], standardize=data["standardize"], **policies)
        directory = out / paths.prepared
        report = feature_report(info, data)
    write_json(out / (DATA_METRICS if paths.task is None else f"{paths.prepared}/{_REPORT}"), report)
    for name, split in splits.items():
        save_dataset(split, directory / f"{name}.parquet")
    info["sizes"] = {name: len(split) for name, split in splits.items()}
    write_json(directory / "info.json", info)
    return info["sizes"]


def feature_report(info: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """What the feature encoding decided (``metrics/data.json``, logged to MLflow): standardisation and why,
    one-hot columns, missing values (filled) and dropped rows."""
    features = info["features"]
    return {
        "source": info["source"],
        "standardize": data["standardize"],
        "standardized": features["mean"] is not None,
        "standardize_reason": features["reason"],
        "features": sum(c["width"] for c in features["columns"]),
        "onehot_columns": {c["name"]: c["width"] for c in features["columns"] if c["kind"] == "onehot"},
        "missing_values": info["missing_values"],
        "missing": data["missing"],
        "dropped_rows": info.get("dropped_rows", 0),
    } | ({"target_scale": info["target_scale"]} if "target_scale" in info else {})


def plan_tokenize(params: Params) -> list[Step]:
    """For text sources, one step per task: the tokenizer (pretrained, or trained on the training split) and
    token ids."""
    return [_tokenize_step(params, task) for task in params.task_names if params.task_data(task).is_text]


def _tokenize_step(params: Params, task: str | None) -> Step:
    data = params.task_data(task)
    step_params = {"tokenizer": params.section("data.tokenizer"), "pretrained": params.pretrained}
    if params.objective != data.task:  # a model's own objective (a causal LM): the texts' labels stay, for
        step_params["task"] = params.objective  # partitions and groups
    inputs: tuple[str, ...] = (TaskPaths(task).text,)
    if task is not None:
        step_params["of_task"] = task
        if not params.pretrained:  # the tasks' one tokenizer (plan_shared_tokenizer)
            step_params["shared"] = TOKENIZER
            inputs += (TOKENIZER,)
    return Step(_named("tokenize", task), "tasks.data:tokenize", step_params, inputs=inputs)


def plan_shared_tokenizer(params: Params) -> list[Step]:
    """In a multi-task run of text without a pretrained model, one step: the tasks' one tokenizer (their bodies
    are one, and so is its embedding), trained on every task's training text."""
    tasks = [task for task in params.tasks if params.task_data(task).is_text]
    if not tasks or params.pretrained:
        return []
    step_params = {"tokenizer": params.section("data.tokenizer"), "tasks": tasks}
    inputs = tuple(TaskPaths(task).text for task in tasks)
    return [Step("tokenizer", "tasks.data:train_shared_tokenizer", step_params, inputs=inputs)]


def train_shared_tokenizer(params: dict[str, Any], root: Path, out: Path, _settings: dict[str, Any]) -> dict[str, Any]:
    """Train one tokenizer on the training text (and corpus) of every task, in the tasks' order."""
    settings = params["tokenizer"]
    files = [root / TaskPaths(task).text / f"{name}.parquet" for task in params["tasks"] for name in ("train", CORPUS)]
    texts = itertools.chain(*(training_texts(load_dataset_file(path)) for path in files if path.is_file()))
    tokenizer = _trained_tokenizer(texts, settings)
    tokenizer.save_pretrained(str(out / TOKENIZER))
    return {"vocab_size": len(tokenizer)}


def _trained_tokenizer(texts, settings: dict[str, Any]):
    return train_tokenizer(
        texts, kind=settings["kind"], vocab_size=settings["vocab_size"], min_frequency=settings["min_frequency"]
    )


def tokenize(params: dict[str, Any], root: Path, out: Path, _settings: dict[str, Any]) -> dict[str, Any]:
    """Tokenize every text split into right-padded token ids; save the tokenizer beside them."""
    settings, paths = params["tokenizer"], TaskPaths(params.get("of_task"))
    tokenizer_dir = TOKENIZER if paths.task is None else f"{paths.prepared}/tokenizer"
    info = read_info(root, paths.text)
    splits = {path.stem: load_dataset_file(path) for path in sorted((root / paths.text).glob("*.parquet"))}
    if params["pretrained"]:
        tokenizer = load_tokenizer(params["pretrained"])
        check_vocabulary(tokenizer, params["pretrained"])
    elif params.get("shared"):
        tokenizer = load_tokenizer(root / params["shared"])
    else:
        texts = itertools.chain(*(training_texts(splits[name]) for name in ("train", CORPUS) if name in splits))
        tokenizer = _trained_tokenizer(texts, settings)
    tokenizer.model_max_length = settings["max_length"]  # so a reloaded tokenizer cuts where the model was trained
    tokenizer.save_pretrained(str(out / tokenizer_dir))
    lengths = {}
    for name, split in splits.items():
        encoded = encode_dataset(split, tokenizer, settings["max_length"])
        save_dataset(encoded, out / paths.prepared / f"{name}.parquet")
        lengths[name] = _mean_length(encoded, tokenizer.pad_token_id)
    info["input_shape"] = [settings["max_length"]]
    info["task"] = params.get("task", info["task"])
    info["tokenizer"] = tokenizer_facts(tokenizer, settings["max_length"]) | {"directory": tokenizer_dir}
    write_json(out / paths.prepared / "info.json", info)
    return {"vocab_size": info["tokenizer"]["vocab_size"], "mean_tokens": lengths}


def _mean_length(encoded, pad_token_id: int) -> float:
    ids = to_arrays(encoded, {"input_shape": [-1], "task": "classification"})[0]
    return round(float((ids != pad_token_id).sum(1).mean()), 2)


def plan_partition(params: Params) -> list[Step]:
    """One step per task (one in a single-task run): partition its training split across its clients."""
    steps, first = [], 0
    for task in params.task_names:
        paths = TaskPaths(task)
        step_params: dict[str, Any] = {"seed": params.seed, "partition": params.section("partition")}
        if task is not None:
            clients = params.tasks[task].clients
            step_params["partition"]["num_clients"] = clients
            step_params |= {"task": task, "first_client": first}
            first += clients
        inputs = (f"{paths.prepared}/train.parquet", f"{paths.prepared}/info.json")
        steps.append(Step(_named("partition", task), "tasks.data:partition", step_params, inputs=inputs))
    return steps


def partition(params: dict[str, Any], root: Path, out: Path, _settings: dict[str, Any]) -> dict[str, Any]:
    """Write one parquet file per client (named by its global id), the partition statistics and their plot."""
    partitioning, paths = params["partition"], TaskPaths(params.get("task"))
    info = read_info(root, paths.prepared)
    train = load_dataset_file(root / paths.prepared / "train.parquet")
    parts = partition_dataset(
        train,
        method=partitioning["method"],
        num_clients=partitioning["num_clients"],
        seed=params["seed"],
        alpha=partitioning["alpha"],
        classes_per_client=partitioning["classes_per_client"],
        min_partition_size=partitioning["min_partition_size"],
    )
    first = params.get("first_client", 0)
    for local, part in enumerate(parts):
        save_dataset(part, out / client_file(first + local))
    write_json(out / paths.partitions_info, info | ({"clients": [first, first + len(parts)]} if paths.task else {}))
    stats = partition_stats(parts, info)
    if paths.task is None:
        write_json(out / PARTITION_METRICS, stats)
        plot_partition_stats(stats, out / PARTITION_PLOT)
    else:
        write_json(out / paths.partitions / _REPORT, stats)
    return {"sizes": stats["sizes"]}


def plan_data_report(params: Params) -> list[Step]:
    """In a multi-task run, one step: ``metrics/data.json``, the tasks' data reports by task."""
    return _report_step(params, "prepare", {task: f"{TaskPaths(task).prepared}/{_REPORT}" for task in params.tasks})


def plan_partition_report(params: Params) -> list[Step]:
    """In a multi-task run, one step: ``metrics/partition.json`` by task, and the plot of every client's classes."""
    reports = {task: f"{TaskPaths(task).partitions}/{_REPORT}" for task in params.tasks}
    return _report_step(params, "partition", reports)


def _report_step(params: Params, stage: str, reports: dict[str, str]) -> list[Step]:
    if not params.multitask:
        return []
    step_params = {"stage": stage, "reports": reports, "order": list(reports)}
    return [Step(f"{stage}/report", "tasks.data:write_report", step_params, inputs=tuple(reports.values()))]


def write_report(params: dict[str, Any], root: Path, out: Path, _settings: dict[str, Any]) -> dict[str, Any]:
    """A stage's report of a multi-task run, by task: ``metrics/data.json``, or ``metrics/partition.json`` and the
    partition plot of every client (its task's classes, named ``<task>:<class>``)."""
    reports = {task: json.loads((root / params["reports"][task]).read_text()) for task in params["order"]}
    if params["stage"] == "prepare":
        write_json(out / DATA_METRICS, reports)
        return {"tasks": len(reports)}
    combined = combine_partition_stats(reports)
    # The clients' sizes by global id, as in a single-task run's report, and each task's own statistics.
    write_json(out / PARTITION_METRICS, {"sizes": combined["sizes"], "tasks": reports})
    plot_partition_stats(combined, out / PARTITION_PLOT)
    return {"clients": combined["num_clients"]}
