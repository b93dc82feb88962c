"""Steps of the ``merge`` stage: one cached step per merge method, or per candidate of a search.

A merge whose options hold lists is a search: each candidate is its own cached step (named by its
options, so adding a value runs only that value), scored on the validation split; a selection step
then keeps the best as the merge's model. The test split is never read here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel
from safetensors.torch import load_file

from mergeflow.checkpoints import checkpoint_header, load_checkpoint, load_checkpoint_meta, save_checkpoint
from mergeflow.config import Params
from mergeflow.heads import head_names
from mergeflow.merge.engine import Scorer, run_merge
from mergeflow.merge.streaming import merge_files
from mergeflow.merge.tasks import merge_tasks
from mergeflow.metric_direction import lower_is_better
from mergeflow.models import family_of, parameter_names
from mergeflow.schema.merge import DECLARED
from mergeflow.schema.search import candidate_id, choose
from tasks.layout import (
    BASE,
    EXTRA_INPUTS,
    PREPARED,
    TaskPaths,
    aligned_checkpoint,
    aligned_factors,
    aligned_fisher,
    aligned_grams,
    candidate_checkpoint,
    client_checkpoint,
    merged_checkpoint,
    merged_pretrained_dir,
)
from tasks.scoring import mean_scores, split_metrics
from tasks.step_devices import device_settings, on_cpu, step_device
from tasks.steps import Step


def _uses_factors(method: str, params: Params) -> bool:
    return "factors" in DECLARED[method].uses and params.fisher.low_rank


def _inputs(method: str, clients: Sequence[int], with_factors: bool) -> tuple[str, ...]:
    paths = [BASE, *(aligned_checkpoint(c) for c in clients)]
    if "fishers" in DECLARED[method].uses:
        paths += [aligned_fisher(c) for c in clients]
    if "grams" in DECLARED[method].uses:
        paths += [aligned_grams(c) for c in clients]
    if with_factors:
        paths += [aligned_factors(c) for c in clients]
    return tuple(paths)


_VALIDATION = (f"{PREPARED}/validation.parquet", f"{PREPARED}/info.json")


def _merge_step(params: Params, name: str, method: str, validated: BaseModel, candidate: bool) -> Step:
    if params.multitask:
        return _task_merge_step(params, name, method, validated, candidate)
    clients = range(params.partition.num_clients)
    options = validated.model_dump(mode="json", exclude_unset=True)  # the options given, as the step's params
    factors = _uses_factors(method, params)
    step_params = {"name": name, "method": method, "options": options, "num_clients": len(clients), "factors": factors}
    declaration = DECLARED[method]
    if (
        "base" in declaration.uses and "base" not in declaration.needs
    ):  # an optional base is the clients' only if they share it
        step_params["shared_base"] = params.finetune.init == "shared"
    inputs = _inputs(method, clients, factors) + _extra_inputs(params)
    if candidate or "scorer" in declaration.uses:  # scored on the validation split, never on test
        step_params |= {
            "noise_std": params.evaluate.noise_std,
            "select_by": params.merge.selection_metric(params.objective),
        }
        inputs += _VALIDATION
    settings = {"stream_above_mb": params.merge.stream_above_mb} | device_settings(params)
    members = (*declaration.modules, *params.model_members)  # the method's code, and the models' for a scored merge
    if not candidate:
        return Step(f"merge/{name}", "tasks.merging:merge_clients", step_params, inputs, settings, members=members)
    step_params["path"] = candidate_checkpoint(name, candidate_id(options))
    step_name = f"merge/{name}/{candidate_id(options)}"
    return Step(step_name, "tasks.merging:merge_candidate", step_params, inputs, settings, members=members)


def plan_merge(params: Params) -> list[list[Step]]:
    """One step per entry of ``merge.methods``, keyed by its options and only the inputs it needs; a search
    is one step per candidate, then (a second wave) a selection step on their validation scores."""
    merges, selections = [], []
    for name in params.merge.methods:
        entry = params.merge.resolve(name)
        if not entry.searched:
            merges.append(_merge_step(params, name, entry.method, entry.candidates[0], candidate=False))
            continue
        steps = [_merge_step(params, name, entry.method, candidate, candidate=True) for candidate in entry.candidates]
        merges += steps
        if params.multitask:
            selections.append(_task_selection_step(params, name, steps, list(entry.searched)))
            continue
        paths = [step.params["path"] for step in steps]
        select = {"name": name, "candidates": paths, "searched": list(entry.searched)}
        select["select_by"] = params.merge.selection_metric(params.objective)
        inputs = (*paths, BASE) + _extra_inputs(params)
        selections.append(Step(f"merge/{name}", "tasks.merging:select_candidate", select, inputs))
    return [merges, selections] if selections else [merges]


def _task_merge_step(params: Params, name: str, method: str, validated: BaseModel, candidate: bool) -> Step:
    """A merge of a multi-task run: the clients' bodies merged, each task's own head kept
    (:func:`mergeflow.merge.tasks.merge_tasks`); a search candidate is scored on every task's validation split."""
    declaration = DECLARED[method]
    options = validated.model_dump(mode="json", exclude_unset=True)
    step_params = {"name": name, "method": method, "options": options, "clients": _task_clients(params)}
    if "base" in declaration.uses and "base" not in declaration.needs:
        step_params["shared_base"] = params.finetune.init == "shared"
    every = [ref.index for ref in params.clients]
    inputs = (*(TaskPaths(task).base for task in params.tasks), *_inputs(method, every, with_factors=False)[1:])
    members = (*declaration.modules, *params.model_members)
    if not candidate:
        return Step(f"merge/{name}", "tasks.merging:merge_task_clients", step_params, inputs, members=members)
    step_params |= {"candidate": candidate_id(options), "noise_std": params.evaluate.noise_std}
    inputs += tuple(f"{TaskPaths(task).prepared}/{name}" for task in params.tasks for name in _VALIDATION_FILES)
    step_name = f"merge/{name}/{candidate_id(options)}"
    return Step(step_name, "tasks.merging:merge_task_candidate", step_params, inputs, members=members)


_VALIDATION_FILES = ("validation.parquet", "info.json")
# What a multi-task search chooses by: the mean over tasks of the validation accuracy ÷ the task's own model's.
_SELECT_BY = "avg_normalized_accuracy"


def _task_clients(params: Params) -> dict[str, list[int]]:
    """Each task's clients, by global id."""
    return {task: [ref.index for ref in params.clients if ref.task == task] for task in params.tasks}


def _task_selection_step(params: Params, name: str, steps: list[Step], searched: list[str]) -> Step:
    """The choice among a multi-task search's candidates: the best average normalised validation accuracy."""
    candidates = [step.params["candidate"] for step in steps]
    clients = _task_clients(params)
    select = {"name": name, "candidates": candidates, "searched": searched, "clients": clients}
    select["noise_std"] = params.evaluate.noise_std
    inputs = [TaskPaths(task).candidate_checkpoint(name, c) for task in params.tasks for c in candidates]
    inputs += [client_checkpoint(c) for ids in clients.values() for c in ids]
    inputs += [f"{TaskPaths(task).prepared}/{name}" for task in params.tasks for name in _VALIDATION_FILES]
    fn = "tasks.merging:select_task_candidate"
    return Step(f"merge/{name}", fn, select, tuple(inputs), members=params.model_members)


def _merge_tasks_into(
    params: dict[str, Any], settings: dict[str, Any], root: Path, out: Path, path_of, scored: bool = False
) -> dict[str, dict[str, Any]]:
    """Merge the aligned client checkpoints of every task with one method: their bodies merged, each task's model
    the merged body with its own clients' head, saved at ``path_of(task)``; ``scored``: each task's model scored on
    the task's validation split (``validation`` in its metadata). Returns each task's metadata."""
    method = params["method"]
    declaration = DECLARED[method]
    metas = {c: load_checkpoint_meta(root / aligned_checkpoint(c)) for ids in params["clients"].values() for c in ids}
    excluded = [c for c, meta in metas.items() if meta.get("diverged")]
    clients = [(task, c) for task, ids in params["clients"].items() for c in ids if c not in excluded]
    base_path = root / TaskPaths(next(iter(params["clients"]))).base
    device = str(step_device(settings))
    uses = declaration.uses
    with_base = "base" in uses and params.get("shared_base", True)

    def load(relative: str) -> dict[str, torch.Tensor]:
        return load_file(root / relative, device=device)

    merged, result = merge_tasks(
        method,
        [load(aligned_checkpoint(c)) for _, c in clients],
        [task for task, _ in clients],
        head_names(load_checkpoint_meta(base_path)["spec"]),
        base=load_file(base_path, device=device) if with_base else None,
        weights=[metas[c]["num_examples"] for _, c in clients],
        fishers=[load(aligned_fisher(c)) for _, c in clients] if "fishers" in uses else None,
        grams=[load(aligned_grams(c)) for _, c in clients] if "grams" in uses else None,
        options=declaration.parse(params["options"]),
    )
    metas_out = {}
    for task, state in merged.items():
        paths = TaskPaths(task)
        spec = load_checkpoint_meta(root / paths.base)["spec"]
        meta = {
            "spec": spec,
            "role": "merged",
            "task": task,
            "name": params["name"],
            "method": method,
            "options": params["options"],
            "excluded_clients": excluded,
            "curves": result.curves,
            "summary": result.summary,
        }
        if scored:
            meta["validation"] = split_metrics(root, "validation", spec, state, params["noise_std"], paths.prepared)
        save_checkpoint(out / path_of(task), on_cpu(state), meta)
        metas_out[task] = meta
    return metas_out


def merge_task_clients(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """One merge of a multi-task run (:func:`_merge_tasks_into`), saved as each task's merged model."""
    metas = _merge_tasks_into(
        params, settings, root, out, lambda task: TaskPaths(task).merged_checkpoint(params["name"])
    )
    return {"method": params["method"], "tasks": len(metas), **next(iter(metas.values()))["summary"]}


def merge_task_candidate(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """One candidate of a multi-task search: merged, and each task's model scored on its validation split."""
    name, candidate = params["name"], params["candidate"]
    metas = _merge_tasks_into(
        params, settings, root, out, lambda task: TaskPaths(task).candidate_checkpoint(name, candidate), scored=True
    )
    return {
        "method": params["method"],
        **{f"{task}.val_{k}": v for task, m in metas.items() for k, v in m["validation"].items()},
    }


def select_task_candidate(params: dict[str, Any], root: Path, out: Path, _settings: dict[str, Any]) -> dict[str, Any]:
    """Keep the candidate whose tasks' models have the best average normalised validation accuracy (each task's
    validation accuracy ÷ its own fine-tuned clients' mean, :func:`mergeflow.task_scores.normalised_validation_score`)
    as the merge's models; record every candidate's score and the choice (``selection`` in their metadata)."""
    from mergeflow.task_scores import normalised_validation_score

    name, tasks = params["name"], list(params["clients"])
    individual = {}
    for task, clients in params["clients"].items():
        prepared = TaskPaths(task).prepared
        scores = []
        for client in clients:
            state, meta = load_checkpoint(root / client_checkpoint(client))
            scores.append(split_metrics(root, "validation", meta["spec"], state, params["noise_std"], prepared))
        individual[task] = mean_scores(scores)
    validation = {
        c: {t: load_checkpoint_meta(root / TaskPaths(t).candidate_checkpoint(name, c))["validation"] for t in tasks}
        for c in params["candidates"]
    }
    scores = [normalised_validation_score(validation[c], individual) for c in params["candidates"]]
    best = max(range(len(scores)), key=lambda k: (scores[k], -k))
    chosen = params["candidates"][best]
    options = [
        load_checkpoint_meta(root / TaskPaths(tasks[0]).candidate_checkpoint(name, c))["options"]
        for c in params["candidates"]
    ]
    selection = {
        "split": "validation",
        "select_by": _SELECT_BY,
        "searched": params["searched"],
        "chosen": best,
        "candidates": [
            {
                "options": own,
                "validation": {_SELECT_BY: score}
                | {f"{task}.{key}": value for task in tasks for key, value in validation[c][task].items()},
            }
            for c, own, score in zip(params["candidates"], options, scores, strict=True)
        ],
    }
    for task in tasks:
        state, meta = load_checkpoint(root / TaskPaths(task).candidate_checkpoint(name, chosen))
        save_checkpoint(out / TaskPaths(task).merged_checkpoint(name), state, meta | {"selection": selection})
    return {"chosen": chosen, "avg_normalized_validation": scores[best]}


def _merge_into(
    params: dict[str, Any], settings: dict[str, Any], root: Path, path: Path, scored: bool = False
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Merge the aligned client checkpoints with one declared method into the checkpoint ``path``.

    ``scored``: a search candidate, whose validation metrics go into its metadata (``validation``).
    Returns the merged state (None when it was streamed from the files and not needed after) and the
    checkpoint's metadata (its summary and curves among them).
    """
    name, method = params["name"], params["method"]
    declaration = DECLARED[method]
    options = declaration.parse(params["options"])  # validated once, here at the step's boundary
    clients = range(params["num_clients"])
    uses = declaration.uses
    metas = [load_checkpoint_meta(root / aligned_checkpoint(c)) for c in clients]  # headers only
    excluded = [c for c, meta in enumerate(metas) if meta.get("diverged")]
    clients = [c for c in clients if c not in excluded]  # finetune.on_divergence: exclude
    base_meta = load_checkpoint_meta(root / BASE)
    meta = {
        "spec": base_meta["spec"],
        "role": "merged",
        "name": name,
        "method": method,
        "options": params["options"],
        "excluded_clients": excluded,
    }
    weights = [metas[c]["num_examples"] for c in clients]
    with_base = "base" in uses and params.get("shared_base", True)
    if _streams(params, settings, root, clients):
        meta |= {"curves": {}, "summary": {}}
        merge_files(
            method,
            [root / aligned_checkpoint(c) for c in clients],
            path,
            base=root / BASE if with_base else None,
            weights=weights,
            fishers=[root / aligned_fisher(c) for c in clients] if "fishers" in uses else None,
            metadata=checkpoint_header(meta),
            device=step_device(settings),
            options=options,
        )
        if not scored:
            return None, meta
        state = load_file(path)  # one model, to score on validation; the header is rewritten with the scores
        meta["validation"] = split_metrics(root, "validation", meta["spec"], state, params["noise_std"])
        save_checkpoint(path, state, meta)
        return state, meta
    # Factor columns follow the model's parameter order; the files list tensors alphabetically.
    order = parameter_names(base_meta["spec"])
    device = str(step_device(settings))

    def load(relative: str) -> dict[str, torch.Tensor]:  # read straight onto the merge's device
        return load_file(root / relative, device=device)

    fishers = None
    if "fishers" in uses:
        fishers = [{n: f[n] for n in order} for f in (load(aligned_fisher(c)) for c in clients)]
    result = run_merge(
        method,
        [load(aligned_checkpoint(c)) for c in clients],
        base=load(BASE) if with_base else None,
        weights=weights,
        fishers=fishers,
        factors=[load(aligned_factors(c))["U"] for c in clients] if params["factors"] else None,
        grams=[load(aligned_grams(c)) for c in clients] if "grams" in uses else None,
        scorer=_validation_scorer(params, root, base_meta["spec"]) if "scorer" in uses else None,
        options=options,
    )
    meta |= {"curves": result.curves, "summary": result.summary}
    if scored:
        meta["validation"] = split_metrics(root, "validation", meta["spec"], result.state, params["noise_std"])
    state = on_cpu(result.state)
    save_checkpoint(path, state, meta)
    return state, meta


def _streams(params: dict[str, Any], settings: dict[str, Any], root: Path, clients: list[int]) -> bool:
    """Whether this merge streams: a tensor-scope method on client checkpoints above ``merge.stream_above_mb``
    (a setting of the step; without it, in memory)."""
    threshold = settings.get("stream_above_mb")
    if threshold is None or DECLARED[params["method"]].scope != "tensor" or not clients:
        return False
    return (root / aligned_checkpoint(clients[0])).stat().st_size > threshold * 2**20


def _validation_scorer(params: dict[str, Any], root: Path, spec: dict[str, Any]) -> Scorer:
    """A state dict's validation score by ``select_by``, signed so that higher is better."""
    metric = params["select_by"]
    sign = -1.0 if lower_is_better(metric) else 1.0

    def score(state: dict[str, Any]) -> float:
        return sign * split_metrics(root, "validation", spec, state, params["noise_std"])[metric]

    return score


def _extra_inputs(params: Params) -> tuple[str, ...]:
    """The prepared artifacts the model family exports with a merged model (the tokenizer)."""
    return tuple(EXTRA_INPUTS[name] for name in params.model.family.extra_inputs)


def _save_pretrained(name: str, state: dict[str, Any] | None, meta: dict[str, Any], root: Path, out: Path) -> None:
    """The family's own directory beside the merged checkpoint, if it exports one (``state`` None: read it)."""
    family = family_of(meta["spec"]["arch"])
    if not family.declaration.exports:
        return
    if state is None:
        state = load_file(out / merged_checkpoint(name))
    inputs = {key: root / EXTRA_INPUTS[key] for key in family.declaration.extra_inputs}
    family.export(meta["spec"], state, out / merged_pretrained_dir(name), inputs)


def merge_clients(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Merge the aligned client checkpoints with one registered method; keep its curves in the metadata."""
    state, meta = _merge_into(params, settings, root, out / merged_checkpoint(params["name"]))
    _save_pretrained(params["name"], state, meta, root, out)
    return {"method": params["method"], **meta["summary"]}


def merge_candidate(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """One candidate of a search: merged, and scored on the validation split (kept in its metadata)."""
    _, meta = _merge_into(params, settings, root, out / params["path"], scored=True)
    return {"method": params["method"], **{f"val_{k}": v for k, v in meta["validation"].items()}, **meta["summary"]}


def select_candidate(params: dict[str, Any], root: Path, out: Path, _settings: dict[str, Any]) -> dict[str, Any]:
    """Keep the candidate with the best validation score as the merge's model; record every candidate's
    score and the choice (``selection`` in its metadata)."""
    metas = [load_checkpoint_meta(root / path) for path in params["candidates"]]  # headers only
    best = choose([meta["validation"] for meta in metas], params["select_by"])
    state, meta = load_checkpoint(root / params["candidates"][best])
    meta["selection"] = {
        "split": "validation",
        "select_by": params["select_by"],
        "searched": params["searched"],
        "chosen": best,
        "candidates": [{"options": m["options"], "validation": m["validation"]} for m in metas],
    }
    save_checkpoint(out / merged_checkpoint(params["name"]), state, meta)
    _save_pretrained(params["name"], state, meta, root, out)
    return {"chosen": {key: meta["options"][key] for key in params["searched"]}, **meta["validation"]}
