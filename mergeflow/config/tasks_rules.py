"""The rules of a multi-task run (params ``tasks``): each task's data, and what the other sections allow
when the clients hold different tasks with heads of their own; and those of federated clients that keep their
own heads (``federated.heads``), in any run."""

from __future__ import annotations

from pydantic import ValidationError

from mergeflow.config.params import Params


def check_tasks(params: Params) -> None:
    """Raise ``ValueError`` (``key: problem``) for the first rule a multi-task run breaks, or the clients' heads
    (``federated.heads``) in any run."""
    _check_heads(params)
    if not params.multitask:
        return
    for name in params.tasks:
        _check_task(params, name)
    if params.model.arch == "linear":
        raise ValueError(
            "model.arch: a linear model is all head: the tasks would share no body to merge; use mlp or cnn"
        )
    if params.align.method != "none":
        raise ValueError(
            "align.method: a multi-task run merges the bodies of clients with their own heads, and permutation "
            "alignment is not implemented for them; set it to none"
        )
    from mergeflow.schema.merge import DECLARED

    for entry in params.merge.methods:
        method = DECLARED[params.merge.method_of(entry)]
        if "factors" in method.uses or "scorer" in method.needs:
            why = (
                "Fisher factors over one shared head" if "factors" in method.uses else "one model on one validation set"
            )
            raise ValueError(
                f"merge.methods: {entry!r} ({method.name}) needs {why}; a multi-task run has a head per task"
            )
    if params.pretrain.language_model is not None:
        raise ValueError("pretrain.language_model: not supported in a multi-task run yet")
    if params.centralized.keep != "last" or params.finetune.lora:
        key = "centralized.keep" if params.centralized.keep != "last" else "finetune.lora"
        raise ValueError(f"{key}: not supported in a multi-task run yet")


def federated_heads(params: Params) -> str:
    """How the run's federated clients hold their heads (``federated.heads`` resolved): shared, local or frozen."""
    return params.federated.heads_of(params.multitask, _has_head(params))


def _has_head(params: Params) -> bool:
    from mergeflow.schema.objectives import declared_objective

    return not declared_objective(params.objective).trains_language_model


def _check_heads(params: Params) -> None:
    """``federated.heads``: one head cannot serve several tasks; a kept head needs a head, full exchange, and
    under ``local`` a point-estimate server state (IVON-ADMM's Gaussian covers every trained parameter)."""
    federated = params.federated
    heads = federated_heads(params)
    if not federated.algorithms:
        return
    if heads == "shared":
        if params.multitask and _has_head(params):
            raise ValueError(
                "federated.heads: shared: the tasks have label sets of their own, which one head cannot serve; "
                "use local (FedPer) or frozen (FedBABU)"
            )
        return
    if not _has_head(params):
        raise ValueError(f"federated.heads: {heads}: a causal language model has no head to keep; use shared")
    if federated.exchange == "adapters":
        raise ValueError(f"federated.heads: {heads} keeps the clients' heads, which exchange: adapters sends; use full")
    from mergeflow.schema.federated import ALGORITHMS

    for name in federated.algorithms:
        algorithm = federated.algorithm_of(name)
        if heads == "local" and not ALGORITHMS[algorithm].point_estimate:
            raise ValueError(
                f"federated.heads: local trains each client's head beside the body, and {name!r} ({algorithm}) "
                "updates a Gaussian over every trained parameter; use frozen (FedBABU)"
            )


def _check_task(params: Params, name: str) -> None:
    try:
        data = params.task_data(name)
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise ValueError(
            f"tasks.{name}.data{'.' + where if where else ''}: {problem['msg'].removeprefix('Value error, ')}"
        ) from None
    if params.tasks[name].labels is not None and data.task != "classification":
        raise ValueError(f"tasks.{name}.labels: relabelling needs classes, and its data is a {data.task} task")
    family = params.model.family
    if (family.inputs == "tokens") != data.is_text:
        raise ValueError(
            f"tasks.{name}.data.source: {data.source!r} does not give what model.arch {params.model.arch!r} takes"
        )
