"""Steps of the ``prepare`` and ``partition`` stages."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np

from mergeflow.config import Params
from mergeflow.data.encode import encode_splits
from mergeflow.data.partition import partition_dataset, partition_stats, plot_partition_stats
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
    PARTITIONS,
    PREPARED,
    TEXT,
    TOKENIZER,
    client_file,
)
from tasks.prepared import read_info
from tasks.steps import Step


def plan_prepare(params: Params) -> list[Step]:
    """One step: build the dataset and its splits (keyed also by the content of local data files, and by the
    chosen source's modules only: another source's code or a new source re-keys nothing)."""
    return [
        Step(
            "prepare",
            "tasks.data:prepare",
            {"seed": params.seed, "data": params.data.for_prepare()},
            inputs=local_data_files(params),
            members=params.data.declaration.modules,
        )
    ]


def prepare(params: dict[str, Any], root: Path, out: Path, _settings: dict[str, Any]) -> dict[str, Any]:
    """Load the source, split it (stratified, seeded), encode numeric features with a transform fitted on
    the training split (one-hot categories, filled gaps, standardisation), save parquet files.

    Text sources are saved as text under ``data/prepared/text``, for the tokenize step.
    """
    data = params["data"]
    source = get_source(data["source"])
    options, loader = source.parse(data[source.name]), source.loader
    fractions = {key: data[key] for key in ("test_fraction", "server_fraction", "validation_fraction")}
    if source.modality(options) == "tokens":
        dataset, info = loader.load(options, seed=params["seed"], data=data)
        splits = split_dataset(dataset, info, **fractions, seed=params["seed"])
        corpus = loader.corpus(options, seed=params["seed"])
        if corpus:  # unlabelled (y = -1): read only by the tokenizer and language-model pre-training
            splits[CORPUS] = make_text_dataset(corpus, np.full(len(corpus), -1, dtype=np.int64))
        directory = out / TEXT
        write_json(out / DATA_METRICS, {"source": info["source"], "standardized": False, "tokenized": True})
    else:
        policies = {"missing": data["missing"], "categorical": data["categorical"]}
        raw = loader.load_raw(options, seed=params["seed"], data=data)
        splits, info = encode_splits(raw, **fractions, seed=params["seed"], standardize=data["standardize"], **policies)
        directory = out / PREPARED
        write_json(out / DATA_METRICS, feature_report(info, data))
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
    """For text sources, one step: the tokenizer (pretrained, or trained on the training split) and token ids."""
    if not params.data.is_text:
        return []
    step_params = {
        "tokenizer": params.section("data.tokenizer"),
        "pretrained": params.pretrained,
    }
    if params.objective != params.data.task:  # a model's own objective (a causal LM): the texts' labels stay, for
        step_params["task"] = params.objective  # partitions and groups
    return [Step("tokenize", "tasks.data:tokenize", step_params, inputs=(TEXT,))]


def tokenize(params: dict[str, Any], root: Path, out: Path, _settings: dict[str, Any]) -> dict[str, Any]:
    """Tokenize every text split into right-padded token ids; save the tokenizer beside them."""
    settings = params["tokenizer"]
    info = read_info(root, TEXT)
    splits = {path.stem: load_dataset_file(path) for path in sorted((root / TEXT).glob("*.parquet"))}
    if params["pretrained"]:
        tokenizer = load_tokenizer(params["pretrained"])
        check_vocabulary(tokenizer, params["pretrained"])
    else:
        texts = itertools.chain(*(training_texts(splits[name]) for name in ("train", CORPUS) if name in splits))
        tokenizer = train_tokenizer(
            texts, kind=settings["kind"], vocab_size=settings["vocab_size"], min_frequency=settings["min_frequency"]
        )
    tokenizer.model_max_length = settings["max_length"]  # so a reloaded tokenizer cuts where the model was trained
    tokenizer.save_pretrained(str(out / TOKENIZER))
    lengths = {}
    for name, split in splits.items():
        encoded = encode_dataset(split, tokenizer, settings["max_length"])
        save_dataset(encoded, out / PREPARED / f"{name}.parquet")
        lengths[name] = _mean_length(encoded, tokenizer.pad_token_id)
    info["input_shape"] = [settings["max_length"]]
    info["task"] = params.get("task", info["task"])
    info["tokenizer"] = tokenizer_facts(tokenizer, settings["max_length"]) | {"directory": TOKENIZER}
    write_json(out / PREPARED / "info.json", info)
    return {"vocab_size": info["tokenizer"]["vocab_size"], "mean_tokens": lengths}


def _mean_length(encoded, pad_token_id: int) -> float:
    ids = to_arrays(encoded, {"input_shape": [-1], "task": "classification"})[0]
    return round(float((ids != pad_token_id).sum(1).mean()), 2)


def plan_partition(params: Params) -> list[Step]:
    """One step: partition the training split across the clients."""
    return [
        Step(
            "partition",
            "tasks.data:partition",
            {"seed": params.seed, "partition": params.section("partition")},
            inputs=(f"{PREPARED}/train.parquet", f"{PREPARED}/info.json"),
        )
    ]


def partition(params: dict[str, Any], root: Path, out: Path, _settings: dict[str, Any]) -> dict[str, Any]:
    """Write one parquet file per client, the partition statistics and their plot."""
    partitioning = params["partition"]
    info = read_info(root)
    train = load_dataset_file(root / PREPARED / "train.parquet")
    parts = partition_dataset(
        train,
        method=partitioning["method"],
        num_clients=partitioning["num_clients"],
        seed=params["seed"],
        alpha=partitioning["alpha"],
        classes_per_client=partitioning["classes_per_client"],
        min_partition_size=partitioning["min_partition_size"],
    )
    for client, part in enumerate(parts):
        save_dataset(part, out / client_file(client))
    write_json(out / PARTITIONS / "info.json", info)
    stats = partition_stats(parts, info)
    write_json(out / PARTITION_METRICS, stats)
    plot_partition_stats(stats, out / PARTITION_PLOT)
    return {"sizes": stats["sizes"]}
