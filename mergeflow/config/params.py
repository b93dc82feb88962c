"""The whole ``params.yaml``: one field per section."""

from __future__ import annotations

from typing import Any

from pydantic import field_validator

from mergeflow.config.analysis_sections import AlignConfig, EvaluateConfig, FisherConfig
from mergeflow.config.data_sections import DataConfig, PartitionConfig
from mergeflow.config.federated_section import FederatedConfig
from mergeflow.config.merge_section import MergeConfig
from mergeflow.config.model_section import ModelConfig
from mergeflow.config.run_sections import OrchestrationConfig, TrackingConfig
from mergeflow.config.section import Section
from mergeflow.config.tasks_section import ClientRef, TaskConfig, check_task_names
from mergeflow.config.training_sections import CentralizedConfig, FinetuneConfig, PretrainConfig


class Params(Section):
    """The whole ``params.yaml``."""

    seed: int = 0
    data: DataConfig = DataConfig()
    partition: PartitionConfig = PartitionConfig()
    model: ModelConfig = ModelConfig()
    pretrain: PretrainConfig = PretrainConfig()
    finetune: FinetuneConfig = FinetuneConfig()
    centralized: CentralizedConfig = CentralizedConfig()
    fisher: FisherConfig = FisherConfig()
    align: AlignConfig = AlignConfig()
    merge: MergeConfig = MergeConfig()
    federated: FederatedConfig = FederatedConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    orchestration: OrchestrationConfig = OrchestrationConfig()
    tracking: TrackingConfig = TrackingConfig()
    tasks: dict[str, TaskConfig] = {}

    @field_validator("tasks")
    @classmethod
    def _task_names(cls, tasks: dict[str, TaskConfig]) -> dict[str, TaskConfig]:
        check_task_names(tasks)
        return tasks

    @property
    def multitask(self) -> bool:
        """Whether the run has several tasks (the ``tasks`` section), each with its own data and head."""
        return bool(self.tasks)

    @property
    def task_names(self) -> tuple[str | None, ...]:
        """The tasks' names in params order; ``(None,)`` for a single-task run."""
        return tuple(self.tasks) if self.tasks else (None,)

    def task_data(self, task: str | None) -> DataConfig:
        """The ``data`` section of ``task`` (the ``data`` section updated with the task's keys); the ``data``
        section itself for None."""
        if task is None:
            return self.data
        return DataConfig.model_validate(self.tasks[task].data_section(self.section("data")))

    @property
    def clients(self) -> list[ClientRef]:
        """Every client, by global id: ``partition.num_clients`` of the one task, or each task's ``clients``."""
        if not self.tasks:
            return [ClientRef(c, None, c) for c in range(self.partition.num_clients)]
        refs: list[ClientRef] = []
        for name, task in self.tasks.items():
            refs += [ClientRef(len(refs) + local, name, local) for local in range(task.clients)]
        return refs

    @property
    def given_clients(self) -> dict[int, tuple[str, str]]:
        """The clients given instead of trained, by global id: the params key that gives each and its source
        (``finetune.checkpoints.N``, or a task's ``tasks.<task>.checkpoint``)."""
        given = {c: (f"finetune.checkpoints.{c}", source) for c, source in sorted(self.finetune.checkpoints.items())}
        for ref in self.clients:
            source = self.tasks[ref.task].checkpoint if ref.task is not None else None
            if source is not None:
                given[ref.index] = (f"tasks.{ref.task}.checkpoint", source)
        return given

    @property
    def num_clients(self) -> int:
        """How many clients the run has (across its tasks)."""
        return len(self.clients)

    @property
    def pretrained(self) -> str | None:
        """The pretrained model the model family starts from (a directory or hub name), if any."""
        key = self.model.family.pretrained_key
        return self.section(key) if key else None

    @property
    def objective(self) -> str:
        """The objective the models learn: the one the model family's options choose (a causal LM), else
        the data's task."""
        return self.model.family.objective(self.model.options) or self.data.task

    @property
    def align_settings(self) -> AlignConfig:
        """The ``align`` section as the align step runs it: the sizes left unset (null) take the model family's
        defaults (:attr:`~mergeflow.schema.families.FamilyDeclaration.align_defaults`)."""
        defaults = self.model.family.align_defaults
        return self.align.model_copy(
            update={key: value for key, value in defaults.items() if getattr(self.align, key) is None}
        )

    @property
    def model_members(self) -> tuple[str, ...]:
        """The modules of the model family and of the objective the run's models use: the members
        (:attr:`tasks.steps.Step.members`) of the steps that build, train or score them."""
        from mergeflow.schema.objectives import declared_objective

        return tuple(m for m in (self.model.family.module, declared_objective(self.objective).module) if m)

    def section(self, dotted: str) -> Any:
        """A section or key as plain JSON data, e.g. ``section("finetune")``."""
        value: Any = self.model_dump(mode="json")
        for part in dotted.split("."):
            value = value[part]
        return value
