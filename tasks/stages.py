"""The one stage registry: each stage's inputs, outputs, params and code.

``dvc.yaml`` is generated from it (``mergeflow dvc-yaml``) and the Prefect pipeline runs
the same stages in the same order, so the two orchestrators cannot drift apart. Paths are
relative to the project root. ``plan`` names the function (``module:function``) that turns
params into the stage's cached steps; it is a string so this module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mergeflow.lazy_imports import closure_with_members
from mergeflow.schema.families import DECLARED as FAMILIES
from mergeflow.schema.federated import member_modules as federated_member_modules
from mergeflow.schema.merge import DECLARED as MERGE_METHODS
from mergeflow.schema.sources import SOURCES

_ROOT = Path(__file__).resolve().parent.parent  # the repository: mergeflow/, tasks/, flows/


@dataclass(frozen=True)
class Stage:
    """One pipeline stage.

    ``deps`` are artifact inputs, ``params`` the params keys it reads, ``outs`` the cached
    output directories (made, empty, even when the params leave the stage nothing to do),
    ``files`` other output files (details, such as per-client curves), ``metrics`` the files of the
    numbers people compare across experiments (DVC's metrics: ``dvc exp show``'s columns), ``plots``
    images; all of them are cached DVC outputs. ``phases`` run one after another; the steps inside one
    phase may run in parallel. ``members`` are the modules of the registered members its steps may run
    (each step names its own: :attr:`tasks.steps.Step.members`). Its code (a DVC dependency, and part of
    every step's cache key) is derived, never listed: :attr:`code`.
    """

    name: str
    summary: str
    phases: tuple[str, ...]
    deps: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    outs: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    plots: tuple[str, ...] = ()
    members: tuple[str, ...] = ()

    @property
    def code(self) -> tuple[str, ...]:
        """Every source file of this repository that the stage's phase modules and its members' modules import,
        transitively (the union of the code of every step it may plan, :attr:`tasks.steps.Step.code`), every
        member their loaders may import included (:func:`mergeflow.lazy_imports.closure_with_members`)."""
        modules = dict.fromkeys([*(phase.partition(":")[0] for phase in self.phases), *self.members])
        return closure_with_members(tuple(modules), _ROOT)

    @property
    def records(self) -> str:
        """The file of the stage's step records, a DVC output: pulled with the data, they let a fresh
        clone's run find the work done (:func:`tasks.records.adopt`)."""
        return f".mergeflow/steps/{self.name}.json"

    @property
    def produced(self) -> tuple[str, ...]:
        """Every path the stage writes."""
        return self.outs + self.files + self.metrics + self.plots


_CENTRALIZED_PARAMS = tuple(
    f"finetune.{key}" for key in ("epochs", "lr", "optimizer", "momentum", "weight_decay", "batch_size", "lora")
)

# A pretrained model's tokenizer tokenizes the text (every family that can start from one).
_PRETRAINED_KEYS = tuple(family.pretrained_key for family in FAMILIES.values() if family.pretrained_key)
# The prepare step reads the chosen source only (its declaration and loader: DataSource.modules); DVC's deps
# are static, so the stage depends on every source's.
_SOURCE_MODULES = tuple(dict.fromkeys(module for source in SOURCES.values() for module in source.modules))
# The merge methods decide which statistics the fisher and align stages compute
# (tasks.merge_statistics.statistics_read). Not merge.options: tuning a merge must not re-run them under DVC
# (a variant's `method` is read there too, and a variant is added to merge.methods by name).
_MERGE_READS = ("merge.methods",)
# Every merge method's modules: dvc.yaml is static, so the merge stage depends on all of them.
_MERGE_MODULES = tuple(dict.fromkeys(module for method in MERGE_METHODS.values() for module in method.modules))
# The only DVC metrics: each model's test headline, NLL and ECE (tasks.layout.HEADLINE), a file per kind
# of model, so that `dvc exp show` names a column by the model alone (it prefixes a file's path only to a
# name that two files share).
HEADLINE_METRICS = tuple(f"metrics/headline/{kind}.json" for kind in ("models", "merged", "federated"))

STAGES: tuple[Stage, ...] = (
    Stage(
        name="prepare",
        summary="Load the data source, split train/test/server (tokenize text), save as parquet datasets.",
        phases=(
            "tasks.data:plan_prepare",
            "tasks.data:plan_shared_tokenizer",
            "tasks.data:plan_tokenize",
            "tasks.data:plan_data_report",
        ),
        params=("seed", "data", "tasks", *_PRETRAINED_KEYS),
        outs=("data/prepared",),
        files=("metrics/data.json",),
        members=_SOURCE_MODULES,
    ),
    Stage(
        name="partition",
        summary="Split the training set across clients with flwr-datasets partitioners.",
        phases=("tasks.data:plan_partition", "tasks.data:plan_partition_report"),
        deps=("data/prepared",),
        params=("seed", "partition", "tasks"),
        outs=("data/partitions",),
        files=("metrics/partition.json",),
        plots=("plots/partition.png",),
    ),
    Stage(
        name="pretrain",
        summary="Train the shared base model on the server split (or initialise it, or read the given one).",
        phases=("tasks.training:plan_pretrain", "tasks.given:plan_given_base"),
        deps=("data/prepared",),
        params=("seed", "model", "pretrain"),
        outs=("models/base",),
    ),
    Stage(
        name="finetune",
        summary="Fine-tune one model per client from the base model, or read the given ones (one cached task per "
        "client).",
        phases=("tasks.training:plan_finetune", "tasks.given:plan_given_clients"),
        deps=("models/base", "data/partitions"),
        params=("seed", "finetune"),
        outs=("models/clients",),
    ),
    Stage(
        name="centralized",
        summary="Train the oracle on the pooled client data with the fine-tuning defaults (or its best epoch).",
        phases=("tasks.training:plan_centralized",),
        deps=("models/base", "data/partitions", "data/prepared"),
        params=("seed", *_CENTRALIZED_PARAMS, "centralized", "merge.select_by", "evaluate.noise_std"),
        outs=("models/centralized",),
    ),
    Stage(
        name="fisher",
        summary="Per-client diagonal Fisher (and optional per-example factors), one cached task per client.",
        phases=("tasks.fisher:plan_fisher",),
        deps=("models/clients", "data/partitions"),
        params=("seed", "fisher", "evaluate.noise_std", *_MERGE_READS),
        outs=("models/fishers",),
    ),
    Stage(
        name="align",
        summary="Permute every client (and its Fisher) to a reference model; loss barriers before and after.",
        phases=("tasks.align:plan_align",),
        deps=("data/prepared", "data/partitions", "models/clients", "models/fishers"),
        params=("seed", "align", "fisher.low_rank", *_MERGE_READS),
        outs=("models/aligned",),
        files=("metrics/align.json",),
        plots=("plots/barrier.png",),
    ),
    Stage(
        name="merge",
        summary="Merge the aligned client models with each method (one cached task per method or searched "
        "candidate; searches chosen on the validation split).",
        phases=("tasks.merging:plan_merge",),
        deps=("models/base", "models/aligned", "data/prepared"),
        params=("merge", "evaluate.noise_std"),
        outs=("models/merged",),
        members=_MERGE_MODULES,
    ),
    Stage(
        name="federated",
        summary="Federated rounds from the base model: cached client updates, then a server update, per round.",
        phases=("tasks.federated:plan_federated",),
        deps=("data/prepared", "data/partitions", "models/base"),
        params=("seed", "federated", "finetune.lora", "partition.num_clients", "evaluate.noise_std"),
        outs=("models/federated",),
        files=("metrics/federated.json",),
        plots=("plots/federated.png",),
        members=federated_member_modules(),  # every algorithm's, aggregator's, …: dvc.yaml is static
    ),
    Stage(
        name="evaluate",
        summary="Test metrics of every model, the comparison plot, and the MLflow runs.",
        phases=("tasks.evaluation:plan_evaluate", "tasks.tracking:plan_track"),
        deps=(
            "data/prepared",
            "models/base",
            "models/clients",
            "models/centralized",
            "models/merged",
            "models/federated",
            "metrics/align.json",
            "plots/barrier.png",
            "metrics/federated.json",
        ),
        params=("evaluate", "tracking"),
        outs=("metrics/tasks",),
        files=("metrics/evaluate.json", "metrics/selection.json"),
        metrics=HEADLINE_METRICS,
        plots=("plots/comparison.png",),
    ),
)

STAGE_NAMES: tuple[str, ...] = tuple(stage.name for stage in STAGES)


def get_stage(name: str) -> Stage:
    """The stage called ``name``; ValueError listing the known names otherwise."""
    for stage in STAGES:
        if stage.name == name:
            return stage
    raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGE_NAMES)}")
