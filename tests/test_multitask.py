"""Multi-task runs: tasks with their own labels and heads, bodies merged with each task's head kept, every task
scored on its own test split (absolute and normalised), searches chosen on validation; the digits preset end to end
with DVC and MLflow."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch
import yaml
from conftest import ROOT, ran_steps, run_cli, schema_defaults
from safetensors.torch import load_file
from test_dvc import _copy_project, _dvc

from mergeflow.checkpoints import load_checkpoint_meta
from mergeflow.config import validate_params
from mergeflow.data.errors import DataError
from mergeflow.data.relabel import relabel_raw
from mergeflow.data.rows import RawData
from mergeflow.errors import ConfigError

PRESET = yaml.safe_load((ROOT / "experiments/multitask_digits.yaml").read_text())
TASKS = list(PRESET["tasks"])


def _raw(y: list[int]) -> RawData:
    features = pa.table({"x": pa.array([float(v) for v in range(len(y))])})
    info = {"num_classes": 4, "class_names": ["a", "b", "c", "d"], "task": "classification"}
    return RawData(features, np.array(y), None, info, np.arange(len(y)))


def test_relabelling_keeps_the_mapped_rows_and_renumbers_the_task_classes():
    raw = relabel_raw(_raw([0, 1, 2, 3, 2, 0]), {0: 5, 2: 5, 3: 9})
    assert raw.y.tolist() == [0, 0, 1, 0, 0]
    assert raw.source_rows.tolist() == [0, 2, 3, 4, 5]
    assert raw.features.column("x").to_pylist() == [0.0, 2.0, 3.0, 4.0, 5.0]
    assert raw.info["num_classes"] == 2 and raw.info["class_names"] == ["a+c", "d"]
    with pytest.raises(DataError, match="no class 7"):
        relabel_raw(_raw([0, 1]), {0: 0, 7: 1})


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"align": {"method": "weights"}}, "align.method"),
        ({"merge": {"methods": ["exact"]}}, "merge.methods"),
        ({"tasks": {"Low": {}}}, "tasks.Low"),
        ({"tasks": {"low": {"labels": {0: 0}}}}, "tasks.low.labels"),
        ({"tasks": {"low": {"data": {"source": "digitz"}}}}, "tasks.low.data.source"),
        ({"tasks": {"low": {"data": {"source": "linreg"}, "labels": {0: 0, 1: 1}}}}, "tasks.low.labels"),
    ],
)
def test_a_multi_task_run_refuses_what_needs_one_head_in_one_line_naming_the_key(changes, key):
    raw = {"tasks": {"low": {"labels": {0: 0, 1: 1}}, "high": {"labels": {8: 0, 9: 1}}}} | changes
    with pytest.raises(ConfigError) as error:
        validate_params(raw)
    assert len(error.value.lines) == 1 and f": {key}: " in error.value.lines[0], error.value.lines


def test_the_centralized_oracle_trains_on_replicated_clients_data_once():
    from tasks.layout import client_file
    from tasks.training import plan_centralized

    replicated = {"partition": {"method": "replicated", "num_clients": 3}}
    (step,) = plan_centralized(validate_params(replicated))
    assert step.params["num_clients"] == 1
    assert [path for path in step.inputs if path.endswith(".parquet") and "client_" in path] == [client_file(0)]
    (step,) = plan_centralized(validate_params({"partition": {"method": "iid", "num_clients": 3}}))
    assert step.params["num_clients"] == 3
    tasks = {"a": {"labels": {0: 0, 1: 1}, "clients": 2}, "b": {"labels": {2: 0, 3: 1}, "clients": 3}}
    (ceiling,) = plan_centralized(validate_params({"tasks": tasks} | replicated))
    assert ceiling.params["clients"] == {"a": [0], "b": [2]}  # each task's first client holds its whole split


def test_clients_are_numbered_across_tasks():
    params = validate_params({"tasks": {"a": {"labels": {0: 0, 1: 1}, "clients": 2}, "b": {"labels": {2: 0, 3: 1}}}})
    assert [(c.index, c.task, c.local) for c in params.clients] == [(0, "a", 0), (1, "a", 1), (2, "b", 0)]


@pytest.fixture(scope="module")
def preset_run(tmp_path_factory, dvc_env):
    """The multi-task digits preset as a project's params.yaml (every other key at its default, as DVC needs),
    run once cold; the project and the finished run."""
    project = _copy_project(tmp_path_factory.mktemp("multitask"), dvc_env)
    params = schema_defaults()
    for section, value in PRESET.items():
        params[section] = params[section] | value if isinstance(value, dict) and section != "tasks" else value
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    done = run_cli(["run"], project, dvc_env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return project, dvc_env


@pytest.mark.slow
def test_the_digits_preset_keeps_every_tasks_head_and_reports_normalised_accuracy(preset_run):
    project, env = preset_run
    clients = {task: f"client_{k:03d}" for k, task in enumerate(TASKS)}  # one client per task, in order
    for method in PRESET["merge"]["methods"]:
        for task, client in clients.items():
            merged = load_file(project / f"models/merged/tasks/{task}/{method}.safetensors")
            own = load_file(project / f"models/clients/{client}.safetensors")
            # The head (the last layer) is the task's client's, bit for bit; the body is merged.
            assert torch.equal(merged["3.weight"], own["3.weight"]) and torch.equal(merged["3.bias"], own["3.bias"])
            assert not torch.equal(merged["1.weight"], own["1.weight"]), (method, task)
    summary = json.loads((project / "metrics/evaluate.json").read_text())
    assert set(summary["tasks"]) == set(TASKS)
    federated = [f"federated/{name}" for name in PRESET["federated"]["algorithms"]]
    models = ("floor", "individual", "centralized", *(f"merged/{m}" for m in PRESET["merge"]["methods"]), *federated)
    for name in models:
        row = summary[name]
        for task in TASKS:
            scores = row["tasks"][task]
            own = json.loads((project / f"metrics/tasks/{task}/evaluate.json").read_text())
            assert scores["accuracy"] == own[name]["accuracy"]
            assert scores["normalized_accuracy"] == pytest.approx(own[name]["accuracy"] / own["individual"]["accuracy"])
        assert row["avg_accuracy"] == pytest.approx(np.mean([row["tasks"][t]["accuracy"] for t in TASKS]))
        normalized = [row["tasks"][t]["normalized_accuracy"] for t in TASKS]
        assert row["avg_normalized_accuracy"] == pytest.approx(np.mean(normalized))
        assert row["avg_accuracy"] > 0.8, name  # far above chance (1/5 and 1/2 per task)
    assert summary["splits"]["models"] == "test"
    assert summary["best_single"]["client"] in range(len(TASKS))  # one client's body with every task's head
    assert summary["best_single"]["avg_accuracy"] < summary["individual"]["avg_accuracy"]
    headline = json.loads((project / "metrics/headline/merged.json").read_text())
    assert set(headline) == set(PRESET["merge"]["methods"]) and "avg_normalized_accuracy" in headline["average"]

    selection = json.loads((project / "metrics/selection.json").read_text())
    for name, record in selection.items():
        assert record["split"] == "validation" and record["select_by"] == "avg_normalized_accuracy"
        scores = [c["validation"]["avg_normalized_accuracy"] for c in record["candidates"]]
        assert record["chosen"] == int(np.argmax(scores)), name

    assert _dvc(["status"], project, env).stdout.strip() == "Data and pipelines are up to date."
    best = run_cli(["best"], project, env)
    assert best.returncode == 0 and "test_avg_normalized_accuracy" in best.stdout, best.stdout + best.stderr
    ranked = {name.partition("/")[2]: summary[name]["avg_normalized_accuracy"] for name in models if "/" in name}
    assert best.stdout.splitlines()[1].split()[0] == max(ranked, key=ranked.get), best.stdout

    again = run_cli(["run"], project, env)
    assert again.returncode == 0 and ran_steps(project) == set(), again.stderr[-2000:]


@pytest.mark.slow
def test_a_run_given_the_first_runs_models_trains_nothing_and_merges_byte_for_byte(preset_run, tmp_path):
    """The guide's walkthrough: the preset's clients and base given to a second pipeline, which trains nothing."""
    first, env = preset_run
    params = {key: value for key, value in PRESET.items() if key in ("seed", "data", "model", "merge")}
    params["tasks"] = {
        task: PRESET["tasks"][task] | {"checkpoint": str(first / f"models/clients/client_{k:03d}.safetensors")}
        for k, task in enumerate(TASKS)
    }
    base = first / f"models/base/tasks/{TASKS[0]}/base.safetensors"
    params |= {"pretrain": {"enabled": False, "checkpoint": str(base)}, "centralized": {"enabled": False}}
    params |= {"federated": {"algorithms": []}, "tracking": {"experiment": "byo"}}
    second = tmp_path / "second"
    second.mkdir()
    (second / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    done = run_cli(["run"], second, env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (second / "models/centralized/tasks").exists()
    for k, task in enumerate(TASKS):
        client = load_checkpoint_meta(second / f"models/clients/client_{k:03d}.safetensors")
        assert client["given"]["kind"] == "mergeflow" and "step_losses" not in client  # imported, not trained
        for method in PRESET["merge"]["methods"]:
            path = f"models/merged/tasks/{task}/{method}.safetensors"
            assert (second / path).read_bytes() == (first / path).read_bytes(), path


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["sequence_classification", "causal_lm"])
def test_text_tasks_share_one_trained_tokenizer_and_each_is_scored_on_its_own_split(objective, tmp_path, cli_env):
    """Two text tasks from two tables (4 topics; 2 genres) with a from-config transformer: one tokenizer trained on
    both, a head per task (a causal LM has none: each task scored by its own token NLL)."""
    from text_fixtures import TINY, write_topic_csv

    table = {
        "path": "csv",
        "data_files": str(write_topic_csv(tmp_path / "topics.csv", rows=300)),
        "text_column": "sentence",
    }
    causal = objective == "causal_lm"
    config = TINY["gpt2" if causal else "bert"]
    params = {
        "data": {"validation_fraction": 0.1, "tokenizer": {"vocab_size": 400, "max_length": 20}},
        "tasks": {
            "topic": {"data": {"source": "text", "text": table | {"label_column": "topic"}}},
            "genre": {"data": {"source": "text", "text": table | {"label_column": "genre"}}},
        },
        "model": {"arch": "transformers", "transformers": {"config": config, "task": objective}},
        "pretrain": {"epochs": 3, "optimizer": "adam", "lr": 0.003},
        "finetune": {"epochs": 3, "optimizer": "adam", "lr": 0.003},
        "fisher": {"kind": "empirical", "n_examples": 32, "batch_size": 16},
        "merge": {"methods": ["average", "task_arithmetic", "fisher"]},
        "federated": {"algorithms": ["fedavg"], "rounds": 1, "local": {"epochs": 1, "optimizer": "adam", "lr": 0.003}},
        "tracking": {"log_models": False},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    done = run_cli(["run"], tmp_path, cli_env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "data/prepared/tokenizer/tokenizer.json").is_file()
    vocab = {
        task: json.loads((tmp_path / f"data/prepared/tasks/{task}/info.json").read_text())["tokenizer"]
        for task in ("topic", "genre")
    }
    assert vocab["topic"] == vocab["genre"] | {"directory": vocab["topic"]["directory"]}  # one tokenizer
    summary = json.loads((tmp_path / "metrics/evaluate.json").read_text())
    for name in ("floor", "individual", "merged/average", "merged/fisher", "federated/fedavg"):
        assert set(summary[name]["tasks"]) == {"topic", "genre"}
    if causal:  # no heads: every task by its own token NLL, no normalised accuracy
        assert "avg_nll" in summary["merged/average"] and "avg_normalized_accuracy" not in summary["merged/average"]
        assert summary["tasks"]["topic"]["headline"] != "accuracy"
    else:
        topic = summary["individual"]["tasks"]["topic"]["accuracy"]
        assert topic > 0.5  # 4 topics: chance 0.25
        assert 0 < summary["merged/average"]["avg_normalized_accuracy"]
