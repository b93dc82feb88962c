"""Step of the ``evaluate`` stage: test metrics of every model and the comparison plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mergeflow import cancel
from mergeflow.checkpoints import load_checkpoint, load_checkpoint_meta, load_model
from mergeflow.config import Params
from mergeflow.data.encode import target_scale
from mergeflow.evaluation import SanityCheck, best_model
from mergeflow.files import write_json
from mergeflow.models import build_from_spec
from mergeflow.objectives import get_objective
from mergeflow.plots import plot_comparison, plot_selection, plot_task_comparison
from mergeflow.task_scores import AVERAGED, models, summarise
from mergeflow.training import predict
from tasks.layout import (
    HEADLINE,
    HEADLINE_KINDS,
    METRICS,
    PLOT,
    SELECTION,
    SELECTION_PLOT,
    SINGLE_TASK,
    TaskPaths,
    client_checkpoint,
)
from tasks.prepared import read_arrays, read_groups, read_info
from tasks.reports import SANITY
from tasks.scoring import mean_scores, score_outputs
from tasks.step_devices import device_settings, step_device
from tasks.steps import Step


def plan_evaluate(params: Params) -> list[list[Step]] | list[Step]:
    """One step over every model the pipeline produced; in a multi-task run, one per task (each on its own test
    split, with its own head), then the summary over the tasks."""
    if not params.multitask:
        return [_evaluate_step(params, None)]
    per_task = [_evaluate_step(params, task) for task in params.tasks]
    reports = {task: TaskPaths(task).evaluation for task in params.tasks}
    summary = {"tasks": reports, "methods": list(params.merge.methods), "objective": params.objective}
    summary_step = Step("evaluate", "tasks.evaluation:summarise_tasks", summary, inputs=tuple(reports.values()))
    return [per_task, [summary_step]]


def _evaluate_step(params: Params, task: str | None) -> Step:
    paths = TaskPaths(task)
    client_ids = [ref.index for ref in params.clients if ref.task == task]
    clients = tuple(client_checkpoint(c) for c in client_ids)
    merged = tuple(paths.merged_checkpoint(m) for m in params.merge.methods)
    federated = {name: paths.global_checkpoint(name, params.federated.rounds) for name in params.federated.algorithms}
    step_params = {
        "evaluate": params.section("evaluate"),
        "num_clients": len(clients),
        "methods": list(params.merge.methods),
        "federated": federated,
        # the source's hints for the sanity warning: in the params, as the step does not import the source
        "likely_causes": list(params.task_data(task).declaration.likely_causes),
    }
    if task is not None:
        every = [ref.index for ref in params.clients]
        step_params |= {"task": task, "clients": client_ids, "every_client": every}
        clients = tuple(client_checkpoint(c) for c in every)
    ceiling = (paths.centralized,) if params.centralized.enabled else ()
    if not ceiling:
        step_params["ceiling"] = False
    inputs = (
        f"{paths.prepared}/train.parquet",
        f"{paths.prepared}/test.parquet",
        f"{paths.prepared}/info.json",
        paths.base,
        *ceiling,
        *clients,
        *merged,
        *federated.values(),
    )
    name = "evaluate" if task is None else f"evaluate/{task}"
    return Step(
        name, "tasks.evaluation:evaluate", step_params, inputs, device_settings(params), members=params.model_members
    )


def evaluate(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Metrics for base, clients, best client, ensemble, centralized, each merge and each federated
    algorithm's final global model; the objective's comparison with centralized (the accuracy gain) for
    the last two. An objective without an output ensemble (a causal LM's outputs are per-row NLLs, not
    token distributions) has no ensemble row.

    For one task of a multi-task run (``task``): on the task's own test split, every model with the task's own
    head; and the ``floor`` (the base body with the head of the task's fine-tuned clients) and the ``individual``
    model (the task's own fine-tuned model: its client's scores, or with several clients their mean)."""
    evaluation, paths = params["evaluate"], TaskPaths(params.get("task"))
    info = read_info(root, paths.prepared)
    objective = get_objective(info["task"])
    X, y = read_arrays(root / paths.prepared / "test.parquet", info)
    groups = read_groups(root / paths.prepared / "test.parquet")
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

    train = read_arrays(root / paths.prepared / "train.parquet", info)
    y_train, y_blind = objective.baseline_targets(train, (X, y), info)
    del train  # only its targets are needed
    hints = _likely_causes(info, params["likely_causes"])
    # each model's predictions (class ids, values in the target's units, NLLs) are checked as it is scored
    sanity_check = SanityCheck(y_train, y_blind, task=objective, hints=hints)

    device = step_device(settings)

    def outputs_of(path: str | None, name: str, model=None) -> np.ndarray:
        """``model``'s outputs, or those of the checkpoint at ``path``."""
        cancel.check()  # a stop waits for one model's scoring at most
        model = (model if path is None else load_model(root / path)).to(device)
        outputs = predict(model, X, task=objective, batch_size=evaluation["batch_size"])
        sanity_check.add(name, objective.predictions(outputs, scale))
        return outputs

    metrics: dict[str, dict[str, Any]] = {"base": score(outputs_of(paths.base, "base"))}
    ensemble = objective.ensemble_accumulator() if objective.declaration.ensembles else None
    kept: list[str] = []  # the clients that did not diverge
    for client in params.get("clients", range(params["num_clients"])):
        name = f"client_{client:03d}"
        outputs = outputs_of(client_checkpoint(client), name)
        metrics[name] = score(outputs)
        if load_checkpoint_meta(root / client_checkpoint(client)).get("diverged"):
            metrics[name]["diverged"] = True  # its start weights; left out of best client and ensemble
        else:
            kept.append(name)
            if ensemble is not None:
                ensemble.add(outputs)
    best = best_model({name: metrics[name] for name in kept}, task=objective)
    metrics["best_client"] = {**metrics[best], "client": int(best.removeprefix("client_"))}
    if paths.task is not None:
        metrics["individual"] = mean_scores([metrics[name] for name in kept])
        with_head = _with_task_head(root, paths, params["clients"])
        metrics["floor"] = score(outputs_of(None, "floor", with_head(paths.base)))
        for client in params["every_client"]:  # each client's body on this task: the best single model's row
            name = f"single/client_{client:03d}"
            metrics[name] = score(outputs_of(None, name, with_head(client_checkpoint(client))))
    if ensemble is not None:
        combined_outputs = ensemble.result()
        sanity_check.add("ensemble", objective.predictions(combined_outputs, scale))
        metrics["ensemble"] = score(combined_outputs)
    if params.get("ceiling", True):  # a multi-task run may leave out its ceiling (centralized.enabled)
        metrics["centralized"] = score(outputs_of(paths.centralized, "centralized"))
    combined = {f"merged/{m}": paths.merged_checkpoint(m) for m in params["methods"]}
    combined |= {f"federated/{name}": path for name, path in params["federated"].items()}
    for name, path in combined.items():
        result = score(outputs_of(path, name))
        versus = objective.versus(result, metrics["centralized"]) if "centralized" in metrics else {}
        metrics[name] = result | versus
    sanity = sanity_check.report()
    splits = {"models": "test", SANITY: "test", "selection": "validation"}  # where each number comes from
    write_json(out / paths.evaluation, {**metrics, SANITY: sanity, "splits": splits})
    if paths.task is not None:
        return {"best_client": best, "warning": sanity["warning"]}
    plot_comparison(metrics, out / PLOT, task=objective.name)
    for kind, rows in headline_metrics(metrics, objective.declaration.headline).items():
        write_json(out / HEADLINE.format(kind=kind), rows)
    _write_selection(root, out, params["methods"], SINGLE_TASK)
    return {"best_client": best, "warning": sanity["warning"]}


def summarise_tasks(params: dict[str, Any], root: Path, out: Path, _settings: dict[str, Any]) -> dict[str, Any]:
    """A multi-task run's summary over its tasks' test metrics (:func:`report_tasks`): ``metrics/evaluate.json``,
    the comparison plot and the DVC headline metrics; and the searched merges' choices."""
    per_task = {task: json.loads((root / path).read_text()) for task, path in params["tasks"].items()}
    summary = report_tasks(per_task, dict.fromkeys(per_task, params["objective"]), out)
    # Every task's merged model records the same choice, on the average normalised validation accuracy.
    _write_selection(root, out, params["methods"], TaskPaths(next(iter(per_task))))
    return {"tasks": len(per_task), "models": len(summary.get("models", {}))}


def _with_task_head(root: Path, paths: TaskPaths, clients: list[int]):
    """A function from a checkpoint's path to the model of its body with the task's fine-tuned head (its clients'
    :func:`mergeflow.heads.task_head`): of the base, the task's floor; of any task's client, that client's body
    scored on this task."""
    from mergeflow.heads import assemble, body_of, head_names, split_head, task_head

    spec = load_checkpoint_meta(root / paths.base)["spec"]
    names = head_names(spec)
    loaded = [load_checkpoint(root / client_checkpoint(c)) for c in clients]
    head = task_head([split_head(state, names)[1] for state, _ in loaded], [m["num_examples"] for _, m in loaded])

    def model_of(path: str):
        model = build_from_spec(spec)
        model.load_state_dict(assemble(body_of(load_checkpoint(root / path)[0], names), head))
        return model

    return model_of


def headline_metrics(metrics: dict[str, dict[str, Any]], headline: str) -> dict[str, dict[str, dict[str, Any]]]:
    """The numbers people compare, by kind of model (``models``, ``merged``, ``federated``): each model's
    test ``headline`` metric (the objective's: accuracy, MSE, perplexity), NLL and ECE where it has them.

    A merge and a federated algorithm are keyed by their own name (``task_arithmetic``, not
    ``merged/task_arithmetic``): the columns of ``dvc exp show`` are these keys.
    """
    return _by_kind(metrics, (headline, "nll", "ece"))


def _write_selection(root: Path, out: Path, methods: list[str], paths: TaskPaths) -> None:
    """``metrics/selection.json`` (the searched merges' candidates and choices) and, for a search, its plot."""
    selection = _selections(root, methods, paths)
    write_json(out / SELECTION, selection)
    if selection:
        plot_selection(selection, out / SELECTION_PLOT)


def _selections(root: Path, methods: list[str], paths: TaskPaths) -> dict[str, dict]:
    """The searched merges' candidates, validation scores and choices, from their checkpoints (one task's)."""
    metas = {name: load_checkpoint_meta(root / paths.merged_checkpoint(name)) for name in methods}
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
