"""Scores of a multi-task run as the merging literature reports them (task arithmetic, TIES, TSV-M,
FusionBench): per task the absolute test metric of each model with that task's head, the accuracy
normalised by the task's own fine-tuned model, and their averages over tasks.

Pure Python: the evaluate step scores each task (``metrics/tasks/<t>/evaluate.json``, the single-task
format) and :func:`summarise` turns those into the run's ``metrics/evaluate.json``:

.. code-block:: text

    {
      "tasks": {"<t>": {"objective": "classification", "headline": "accuracy", "clients": [0, 1]}, ...},
      "<model>": {
        "tasks": {"<t>": {<the task's test metrics of the model>, "normalized_accuracy": 0.97}, ...},
        "avg_accuracy": 0.91, "avg_normalized_accuracy": 0.95, "avg_nll": 0.31
      },
      ...
      "best_single": {<the row of the best single/client_XXX>, "client": 3},
      "client_XXX": {"tasks": {"<its task>": {...}}, "avg_...": ...},
      "sanity": {"warning": "<t>: ..." or null, "tasks": {"<t>": <the task's sanity report>}},
      "splits": {"models": "test", "sanity": "test", "selection": "validation"}
    }

Rows (``<model>``): every model scored on every task: ``base`` (the base model with the task's starting
head), ``floor`` (the base body with the task's fine-tuned head), ``individual`` (the task's own fine-tuned
model: its client, with several clients their mean score), ``centralized`` (the ceiling: one body
trained jointly with a head per task; only when it ran), ``merged/<m>``, ``federated/<alg>`` and
``single/client_XXX`` (optional: one client's fine-tuned body with each task's fine-tuned head, scored
on every task);
``best_single`` is the best of those by the headline average. A client (``client_XXX``) is scored on
its own task only: its row holds that task. ``tasks.<t>.clients`` are the global ids of the task's clients.

Normalised accuracy, per task: the model's accuracy ÷ the task's ``individual`` accuracy (1 = as good
as the task's own model; NaN when that accuracy is 0). A task without accuracy (scored by NLL: a causal
LM's token NLL, a regression) has no normalised accuracy: a ratio of likelihoods is not what papers
report. ``avg_<metric>`` (``accuracy``, ``normalized_accuracy``, ``nll``) is the mean over the row's
tasks, present when every one of them has the metric. The run's headline (:func:`headline`) is
``avg_normalized_accuracy`` when every task has accuracy, else ``avg_nll``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from mergeflow.metric_direction import lower_is_better
from mergeflow.schema.objectives import declared_objective

AVERAGED = ("accuracy", "normalized_accuracy", "nll")  # the metrics averaged over tasks, as avg_<metric>
INDIVIDUAL = "individual"
SINGLE = "single/"  # the prefix of a client's body scored on every task with each task's head
BEST_SINGLE = "best_single"
SPLITS = {"models": "test", "sanity": "test", "selection": "validation"}  # where each number comes from
_SANITY = "sanity"  # a task's input-blind baseline report in its evaluate.json (tasks.reports.SANITY)
_NOT_MODELS = (_SANITY, "splits")


def is_summary(metrics: Mapping[str, Any]) -> bool:
    """Whether ``metrics`` (an ``evaluate.json``, or one model's row of it) is multi-task: it has ``tasks``."""
    return "tasks" in metrics


def headline(summary: Mapping[str, Any]) -> str:
    """The average that ranks a multi-task run's models: ``avg_normalized_accuracy`` when every task is
    scored by accuracy, else ``avg_nll``."""
    scored_by_accuracy = all(task["headline"] == "accuracy" for task in summary["tasks"].values())
    return "avg_normalized_accuracy" if scored_by_accuracy else "avg_nll"


def models(summary: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The summary's model rows (every entry but ``tasks``, ``sanity`` and ``splits``)."""
    return {name: row for name, row in summary.items() if name not in ("tasks", *_NOT_MODELS)}


def summarise(per_task: Mapping[str, Mapping[str, dict]], objectives: Mapping[str, str]) -> dict[str, Any]:
    """The multi-task ``metrics/evaluate.json`` (the module's docstring) from each task's test metrics.

    Args:
        per_task: per task (in params order), ``{model_name: metrics}`` as a single-task
            ``evaluate.json`` holds them (its ``sanity`` and ``splits`` entries are read as such).
        objectives: each task's objective name (``classification``, ``causal_lm``, …).

    Raises:
        ValueError: a task without an objective or without its ``individual`` model.
    """
    tasks = list(per_task)
    for task in tasks:
        if task not in objectives:
            raise ValueError(f"task {task!r}: no objective given")
        if INDIVIDUAL not in per_task[task]:
            raise ValueError(f"task {task!r}: no {INDIVIDUAL!r} model to normalise by")
    scored = {task: {n: m for n, m in per_task[task].items() if n not in _NOT_MODELS} for task in tasks}
    individual = {task: scored[task][INDIVIDUAL] for task in tasks}
    clients = {task: sorted(n for n in scored[task] if _is_client(n)) for task in tasks}
    summary: dict[str, Any] = {
        "tasks": {
            task: {
                "objective": objectives[task],
                "headline": declared_objective(objectives[task]).headline,
                "clients": [int(name.removeprefix("client_")) for name in clients[task]],
            }
            for task in tasks
        }
    }
    everywhere = [n for n in scored[tasks[0]] if not _is_client(n) and all(n in scored[t] for t in tasks)]
    for name in everywhere:
        summary[name] = _row({task: scored[task][name] for task in tasks}, individual)
    singles = {name: summary[name] for name in everywhere if name.startswith(SINGLE)}
    if singles:
        best = _best(singles, headline(summary))
        summary[BEST_SINGLE] = {**singles[best], "client": int(best.removeprefix(f"{SINGLE}client_"))}
    for task in tasks:
        for name in clients[task]:
            summary[name] = _row({task: scored[task][name]}, individual)
    reports = {task: per_task[task][_SANITY] for task in tasks if _SANITY in per_task[task]}
    warnings = [f"{task}: {report['warning']}" for task, report in reports.items() if report.get("warning")]
    summary[_SANITY] = {"warning": "; ".join(warnings) or None, "tasks": reports}
    summary["splits"] = dict(SPLITS)
    return summary


def normalised_validation_score(
    per_task_validation: Mapping[str, Mapping[str, float]], individual_validation: Mapping[str, Mapping[str, float]]
) -> float:
    """The selection score of a search in a multi-task run: the mean over tasks of the model's normalised
    VALIDATION score, higher is better, 1 = as good as each task's own model.

    Per task: validation accuracy ÷ the individual model's; for a task without accuracy (scored by NLL)
    the individual's validation NLL ÷ the model's (a likelihood ratio, so that higher is better there too).
    Both arguments are ``{task: validation metrics}`` of the same tasks.

    Raises:
        ValueError: naming the tasks that one of the two lacks.
    """
    unmatched = sorted(set(per_task_validation) ^ set(individual_validation))
    if unmatched or not per_task_validation:
        raise ValueError(f"validation scores of the model and of the individual models differ in tasks: {unmatched}")
    scores = []
    for task, model in per_task_validation.items():
        own = individual_validation[task]
        if "accuracy" in model:
            scores.append(_ratio(model["accuracy"], own["accuracy"]))
        else:
            scores.append(_ratio(own["nll"], model["nll"]))
    return _mean(scores)


def _is_client(name: str) -> bool:
    return name.startswith("client_")


def _ratio(numerator: float, denominator: float) -> float:
    return float(numerator) / float(denominator) if denominator else math.nan


def _mean(values: Iterable[float]) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values)


def _row(scores: Mapping[str, dict], individual: Mapping[str, dict]) -> dict[str, Any]:
    """One model's per-task metrics (each with its normalised accuracy) and their averages over its tasks."""
    per_task = {}
    for task, metrics in scores.items():
        per_task[task] = dict(metrics)
        if "accuracy" in metrics:
            per_task[task]["normalized_accuracy"] = _ratio(metrics["accuracy"], individual[task]["accuracy"])
    row: dict[str, Any] = {"tasks": per_task}
    for key in AVERAGED:
        values = [metrics[key] for metrics in per_task.values() if key in metrics]
        if len(values) == len(per_task):
            row[f"avg_{key}"] = _mean(values)
    return row


def _best(rows: Mapping[str, dict], metric: str) -> str:
    """The row best by ``metric`` (ties: the alphabetically first name)."""
    sign = 1.0 if lower_is_better(metric) else -1.0
    return min(rows, key=lambda name: (sign * rows[name][metric], name))
