"""Step of the ``evaluate`` stage: test metrics of every model and the comparison plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mergeflow import cancel
from mergeflow.checkpoints import load_checkpoint_meta, load_model
from mergeflow.config import Params
from mergeflow.data.encode import target_scale
from mergeflow.evaluation import best_model, sanity_check
from mergeflow.files import write_json
from mergeflow.objectives import get_objective
from mergeflow.plots import plot_comparison, plot_selection, plot_task_comparison
from mergeflow.task_scores import AVERAGED, models, summarise
from mergeflow.training import predict
from tasks.layout import (
    BASE,
    CENTRALIZED,
    HEADLINE,
    HEADLINE_KINDS,
    METRICS,
    PLOT,
    PREPARED,
    SELECTION,
    SELECTION_PLOT,
    client_checkpoint,
    global_checkpoint,
    merged_checkpoint,
)
from tasks.prepared import read_arrays, read_groups, read_info
from tasks.reports import SANITY
from tasks.scoring import score_outputs
from tasks.step_devices import device_settings, step_device
from tasks.steps import Step


def plan_evaluate(params: Params) -> list[Step]:
    """One step over every model the pipeline produced."""
    clients = tuple(client_checkpoint(c) for c in range(params.partition.num_clients))
    merged = tuple(merged_checkpoint(m) for m in params.merge.methods)
    federated = {name: global_checkpoint(name, params.federated.rounds) for name in params.federated.algorithms}
    step_params = {
        "evaluate": params.section("evaluate"),
        "num_clients": len(clients),
        "methods": list(params.merge.methods),
        "federated": federated,
        # the source's hints for the sanity warning: in the params, as the step does not import the source
        "likely_causes": list(params.data.declaration.likely_causes),
    }
    return [
        Step(
            "evaluate",
            "tasks.evaluation:evaluate",
            step_params,
            inputs=(
                f"{PREPARED}/train.parquet",
                f"{PREPARED}/test.parquet",
                f"{PREPARED}/info.json",
                BASE,
                CENTRALIZED,
                *clients,
                *merged,
                *federated.values(),
            ),
            settings=device_settings(params),
            members=params.model_members,
        )
    ]


def evaluate(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Metrics for base, clients, best client, ensemble, centralized, each merge and each federated
    algorithm's final global model; the objective's comparison with centralized (the accuracy gain) for
    the last two. An objective without an output ensemble (a causal LM's outputs are per-row NLLs, not
    token distributions) has no ensemble row."""
    evaluation = params["evaluate"]
    info = read_info(root)
    objective = get_objective(info["task"])
    X, y = read_arrays(root / PREPARED / "test.parquet", info)
    groups = read_groups(root / PREPARED / "test.parquet")
    scale = target_scale(info)  # a standardised regression target

    def score(outputs: np.ndarray) -> dict[str, Any]:
        result: dict[str, Any] = score_outputs(outputs, y, info, evaluation["noise_std"], evaluation["ece_bins"])
        if groups is not None:  # the data's group column (domain, genre, part of speech, …)
            result["by_group"] = {
                str(g): score_outputs(
                    outputs[groups == g], y[groups == g], info, evaluation["noise_std"], evaluation["ece_bins"]
                )
                for g in np.unique(groups)
            }
        return result

    predictions: dict[str, np.ndarray] = {}  # for the sanity check: class ids, values in the target's units, NLLs

    device = step_device(settings)

    def outputs_of(path: str, name: str) -> np.ndarray:
        cancel.check()  # a stop waits for one model's scoring at most
        model = load_model(root / path).to(device)
        outputs = predict(model, X, task=objective, batch_size=evaluation["batch_size"])
        predictions[name] = objective.predictions(outputs, scale)
        return outputs

    metrics: dict[str, dict[str, Any]] = {"base": score(outputs_of(BASE, "base"))}
    client_outputs = {}
    for client in range(params["num_clients"]):
        name = f"client_{client:03d}"
        outputs = outputs_of(client_checkpoint(client), name)
        metrics[name] = score(outputs)
        if load_checkpoint_meta(root / client_checkpoint(client)).get("diverged"):
            metrics[name]["diverged"] = True  # its start weights; left out of best client and ensemble
        else:
            client_outputs[name] = outputs
    best = best_model({name: metrics[name] for name in client_outputs}, task=objective)
    metrics["best_client"] = {**metrics[best], "client": int(best.removeprefix("client_"))}
    if objective.declaration.ensembles:
        ensemble = objective.ensemble(list(client_outputs.values()))
        predictions["ensemble"] = objective.predictions(ensemble, scale)
        metrics["ensemble"] = score(ensemble)
    metrics["centralized"] = score(outputs_of(CENTRALIZED, "centralized"))
    combined = {f"merged/{m}": merged_checkpoint(m) for m in params["methods"]}
    combined |= {f"federated/{name}": path for name, path in params["federated"].items()}
    for name, path in combined.items():
        result = score(outputs_of(path, name))
        metrics[name] = result | objective.versus(result, metrics["centralized"])
    train = read_arrays(root / PREPARED / "train.parquet", info)
    y_train, y_blind = objective.baseline_targets(train, (X, y), info)
    hints = _likely_causes(info, params["likely_causes"])
    sanity = sanity_check(predictions, y_train, y_blind, task=objective, hints=hints)
    plot_comparison(metrics, out / PLOT, task=objective.name)
    splits = {"models": "test", SANITY: "test", "selection": "validation"}  # where each number comes from
    write_json(out / METRICS, {**metrics, SANITY: sanity, "splits": splits})
    for kind, rows in headline_metrics(metrics, objective.declaration.headline).items():
        write_json(out / HEADLINE.format(kind=kind), rows)
    selection = _selections(root, params["methods"])
    write_json(out / SELECTION, selection)
    if selection:
        plot_selection(selection, out / SELECTION_PLOT)
    return {"best_client": best, "warning": sanity["warning"]}


def headline_metrics(metrics: dict[str, dict[str, Any]], headline: str) -> dict[str, dict[str, dict[str, Any]]]:
    """The numbers people compare, by kind of model (``models``, ``merged``, ``federated``): each model's
    test ``headline`` metric (the objective's: accuracy, MSE, perplexity), NLL and ECE where it has them.

    A merge and a federated algorithm are keyed by their own name (``task_arithmetic``, not
    ``merged/task_arithmetic``): the columns of ``dvc exp show`` are these keys.
    """
    return _by_kind(metrics, (headline, "nll", "ece"))


def _selections(root: Path, methods: list[str]) -> dict[str, dict]:
    """The searched merges' candidates, validation scores and choices, from their checkpoints."""
    metas = {name: load_checkpoint_meta(root / merged_checkpoint(name)) for name in methods}
    return {name: meta["selection"] for name, meta in metas.items() if "selection" in meta}


def _likely_causes(info: dict[str, Any], source_causes: list[str]) -> str:
    """What most often keeps a model at the input-blind baseline, for this kind of data (``source_causes``:
    its source's own)."""
    causes = ["too high a learning rate (finetune.lr, pretrain.lr)", "too few epochs"]
    if "features" in info and info["features"]["mean"] is None:
        causes.insert(0, "unscaled features (data.standardize)")
    causes += source_causes
    return ", ".join(causes) + "."


def report_tasks(per_task: dict[str, dict[str, dict]], objectives: dict[str, str], out: Path) -> dict[str, Any]:
    """A multi-task run's reports under ``out``, from each task's test metrics (``{task: {model: metrics}}``,
    each task's ``evaluate.json``) and objective names: ``metrics/evaluate.json`` (the summary,
    :func:`mergeflow.task_scores.summarise`), the comparison plot per task and on average, and the DVC
    headline metrics (:func:`task_headline_metrics`). Returns the summary."""
    summary = summarise(per_task, objectives)
    plot_task_comparison(summary, out / PLOT)
    write_json(out / METRICS, summary)
    for kind, rows in task_headline_metrics(summary).items():
        write_json(out / HEADLINE.format(kind=kind), rows)
    return summary


def task_headline_metrics(summary: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """A multi-task run's numbers people compare, by kind of model as :func:`headline_metrics` gives them:
    each model's averages over tasks (``avg_accuracy``, ``avg_normalized_accuracy``, ``avg_nll`` where it
    has them)."""
    return _by_kind(models(summary), tuple(f"avg_{key}" for key in AVERAGED))


def _by_kind(metrics: dict[str, dict[str, Any]], keys: tuple[str, ...]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each model's ``keys`` by kind: ``merged/<m>`` and ``federated/<a>`` under their kind and own name, any
    other model (``single/client_000`` too) under ``models`` and its full name."""
    kinds: dict[str, dict[str, dict[str, Any]]] = {kind: {} for kind in HEADLINE_KINDS}
    for name, scores in metrics.items():
        kind, _, model = name.partition("/")
        kind, model = (kind, model) if kind in kinds and model else ("models", name)
        kinds[kind][model] = {key: scores[key] for key in keys if key in scores}
    return kinds
