"""The rules of a multi-task run (params ``tasks``): each task's data, and what the other sections allow
when the clients hold different tasks with heads of their own."""

from __future__ import annotations

from pydantic import ValidationError

from mergeflow.config.params import Params


def check_tasks(params: Params) -> None:
    """Raise ``ValueError`` (``key: problem``) for the first rule a multi-task run breaks; nothing without tasks."""
    if not params.multitask:
        if not params.centralized.enabled:
            raise ValueError(
                "centralized.enabled: a single-task run always trains its centralized model; set it to true"
            )
        return
    for name in params.tasks:
        _check_task(params, name)
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
    if params.centralized.keep != "last" or params.finetune.lora:
        key = "centralized.keep" if params.centralized.keep != "last" else "finetune.lora"
        raise ValueError(f"{key}: not supported in a multi-task run yet")
    if params.federated.algorithms:
        raise ValueError(
            "federated.algorithms: federated rounds with a head per task are not supported yet; set it to []"
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
    if data.is_text and not params.pretrained:
        raise ValueError(
            f"tasks.{name}: the tasks' texts share one tokenizer: the pretrained model's "
            "(set model.transformers.pretrained)"
        )
