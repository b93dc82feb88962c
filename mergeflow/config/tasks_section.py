"""The ``tasks`` section: several tasks, each with its own data, label set and head (a multi-task run).

Empty (the default), the run has one task: the ``data`` section's. Given, every task is a data section of its
own (the ``data`` section updated with the task's ``data`` keys, :meth:`TaskConfig.data_section`), with an
optional relabelling of its source's labels, split across ``clients`` clients by the ``partition`` section's
partitioner. The merges combine the clients' bodies; each task keeps its own head.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator, model_validator

from mergeflow.config.section import Section

_TASK_NAME = re.compile(r"^[a-z0-9_]+$")


class TaskConfig(Section):
    """One task: its data (keys of the ``data`` section over it), its labels and how many clients hold it.

    ``labels`` maps the source's labels to the task's (the task's label set is the values, renumbered
    0..C-1 in sorted order); rows whose label is not a key are dropped. ``clients``: the clients the task's
    training split is partitioned across (``partition.method`` and its options). ``checkpoint``: the task's
    fine-tuned model, given instead of trained (a source as ``finetune.checkpoints`` takes: a mergeflow checkpoint,
    a Hugging Face directory, a PEFT LoRA adapter on the base, a Hub name); the task then has one client.
    """

    data: dict[str, Any] = {}
    labels: dict[int, int] | None = None
    clients: int = Field(1, ge=1)
    checkpoint: str | None = None

    @field_validator("labels")
    @classmethod
    def _labels_form_a_set(cls, labels: dict[int, int] | None) -> dict[int, int] | None:
        if labels is not None and len(set(labels.values())) < 2:
            raise ValueError("a task needs at least two labels")
        return labels

    @model_validator(mode="after")
    def _one_given_client(self) -> TaskConfig:
        if self.checkpoint is not None and self.clients != 1:
            raise ValueError("clients: a task given as a checkpoint is one client; set clients: 1")
        return self

    def data_section(self, data: dict[str, Any]) -> dict[str, Any]:
        """The task's raw ``data`` section: ``data`` (the params' own, as JSON) updated with the task's keys (a
        source's options section merged key by key)."""
        merged = dict(data)
        for key, value in self.data.items():
            both_sections = isinstance(value, dict) and isinstance(merged.get(key), dict)
            merged[key] = merged[key] | value if both_sections else value
        return merged


def check_task_names(tasks: dict[str, TaskConfig]) -> None:
    """``ValueError`` naming the first task whose name is not ``[a-z0-9_]+`` (it is a directory and a metric prefix)."""
    for name in tasks:
        if not _TASK_NAME.match(name):
            raise ValueError(f"{name}: a task's name is lower-case letters, digits and _")


@dataclass(frozen=True)
class ClientRef:
    """A client: its global id (``index``: tasks in params order, then each task's own clients), its task
    (None in a single-task run) and its index among the task's clients (``local``)."""

    index: int
    task: str | None
    local: int
