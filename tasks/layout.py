"""Where the pipeline's artifacts live: every path a step writes or reads, relative to the project root.

Plain names, the standard library only: a step reads what the stages before it wrote by importing
their paths from here, not from their modules, so its cache key (the import closure of its module,
:attr:`tasks.steps.Step.code`) holds its own code and no sibling step's. The stages' declared
outputs (:data:`tasks.stages.STAGES`) are these paths; ``tests/test_layout.py`` checks that they agree.
"""

from __future__ import annotations

import dataclasses

# prepare
PREPARED = "data/prepared"
TEXT = f"{PREPARED}/text"  # a text source's splits, before the tokenize step turns them into token ids
CORPUS = "corpus"  # the split of unlabelled text some sources bring for pre-training
TOKENIZER = f"{PREPARED}/tokenizer"
DATA_METRICS = "metrics/data.json"
# Where the prepared artifacts a model family may need (its declared extra inputs) live.
EXTRA_INPUTS = {"tokenizer": TOKENIZER}

# partition
PARTITIONS = "data/partitions"
PARTITION_METRICS = "metrics/partition.json"
PARTITION_PLOT = "plots/partition.png"


def client_file(client: int) -> str:
    """Relative path of one client's partition."""
    return f"{PARTITIONS}/client_{client:03d}.parquet"


# pretrain, finetune, centralized
BASE = "models/base/base.safetensors"
CLIENTS = "models/clients"
CENTRALIZED = "models/centralized/centralized.safetensors"


def client_checkpoint(client: int) -> str:
    """Relative path of one client's fine-tuned model."""
    return f"{CLIENTS}/client_{client:03d}.safetensors"


# fisher
FISHERS = "models/fishers"


def fisher_file(client: int) -> str:
    """Relative path of one client's diagonal Fisher (safetensors, parameter names as keys)."""
    return f"{FISHERS}/client_{client:03d}.safetensors"


def grams_file(client: int) -> str:
    """Relative path of one client's Gram matrices of linear-layer inputs (keys: the layers' weights)."""
    return f"{FISHERS}/client_{client:03d}.grams.safetensors"


def factors_file(client: int) -> str:
    """Relative path of one client's Fisher factors U (key ``U``, F ≈ UᵀU)."""
    return f"{FISHERS}/client_{client:03d}.factors.safetensors"


def statistics_files(statistics: tuple[str, ...], client: int) -> list[str]:
    """Relative paths of one client's files of those statistics (``fishers``, ``grams``, ``factors``)."""
    paths = {"fishers": fisher_file, "grams": grams_file, "factors": factors_file}
    return [paths[statistic](client) for statistic in statistics]


# align
ALIGNED = "models/aligned"
ALIGN_METRICS = "metrics/align.json"
BARRIER_PLOT = "plots/barrier.png"


def aligned_checkpoint(client: int) -> str:
    """Relative path of one client's model after alignment."""
    return f"{ALIGNED}/client_{client:03d}.safetensors"


def aligned_fisher(client: int) -> str:
    """Relative path of one client's diagonal Fisher, permuted like its model."""
    return f"{ALIGNED}/client_{client:03d}.fisher.safetensors"


def aligned_grams(client: int) -> str:
    """Relative path of one client's linear-layer input Grams, permuted like its model's inputs."""
    return f"{ALIGNED}/client_{client:03d}.grams.safetensors"


def aligned_factors(client: int) -> str:
    """Relative path of one client's Fisher factors with permuted columns."""
    return f"{ALIGNED}/client_{client:03d}.factors.safetensors"


# merge
MERGED = "models/merged"


def merged_checkpoint(name: str) -> str:
    """Relative path of one merge's model (``name`` is an entry of ``merge.methods``)."""
    return f"{MERGED}/{name}.safetensors"


def merged_pretrained_dir(name: str) -> str:
    """The directory beside the checkpoint that the model family's ecosystem loads, for a family that
    exports one (transformers: ``from_pretrained``'s weights, config and tokenizer)."""
    return f"{MERGED}/{name}"


def candidate_checkpoint(name: str, candidate: str) -> str:
    """Relative path of one candidate of a searched merge (``candidate``: its options' id,
    :func:`mergeflow.schema.search.candidate_id`)."""
    return f"{MERGED}/{name}.candidates/{candidate}.safetensors"


# federated
FEDERATED = "models/federated"
FEDERATED_INDEX = f"{FEDERATED}/index.json"
FEDERATED_METRICS = "metrics/federated.json"
FEDERATED_PLOT = "plots/federated.png"


def _round_dir(name: str, round_index: int) -> str:
    return f"{FEDERATED}/{name}/round_{round_index:03d}"


def server_file(name: str, round_index: int) -> str:
    """The algorithm's server state after ``round_index`` rounds (0 = initial)."""
    return f"{_round_dir(name, round_index)}/server.safetensors"


def global_checkpoint(name: str, round_index: int) -> str:
    """The global model after ``round_index`` rounds, as a loadable checkpoint (the final one: after
    ``federated.rounds``)."""
    return f"{_round_dir(name, round_index)}/global.safetensors"


def round_metrics_file(name: str, round_index: int) -> str:
    """Test metrics of the global model after ``round_index`` rounds, with drift and train loss."""
    return f"{_round_dir(name, round_index)}/metrics.json"


def client_state_file(name: str, round_index: int, client: int) -> str:
    """A client's state (e.g. its duals) after its update in ``round_index`` (0 = initial); not written
    when empty (FedAvg, FedProx: the file would hold nothing, and cost a file per client update)."""
    return f"{_round_dir(name, round_index)}/client_{client:03d}.state.safetensors"


def message_file(name: str, round_index: int, client: int) -> str:
    """What a client sent to the server in ``round_index``: its tensors, and its local training metrics
    (e.g. its last-epoch loss) in the header (:func:`tasks.federated.read_message`), as Flower's ``FitRes``
    carries both."""
    return f"{_round_dir(name, round_index)}/client_{client:03d}.message.safetensors"


# evaluate
METRICS = "metrics/evaluate.json"
SELECTION = "metrics/selection.json"
PLOT = "plots/comparison.png"
SELECTION_PLOT = "plots/selection.png"
# DVC's metrics (tasks.stages.HEADLINE_METRICS): a file per kind of model, keyed by the model's name.
HEADLINE = "metrics/headline/{kind}.json"
HEADLINE_KINDS = ("models", "merged", "federated")


# A multi-task run (params ``tasks``): what belongs to one task lies under ``tasks/<task>`` inside its stage's own
# output directory, so that the stages' (DVC's) outputs stay the same; what belongs to one client keeps the paths
# above, by its global id.
TASKS_DIR = "tasks"
TASK_METRICS = "metrics/tasks"


@dataclasses.dataclass(frozen=True)
class TaskPaths:
    """The paths of one task's artifacts; ``TaskPaths(None)``: exactly the single-task run's paths above."""

    task: str | None = None

    def _in(self, directory: str) -> str:
        return directory if self.task is None else f"{directory}/{TASKS_DIR}/{self.task}"

    @property
    def prepared(self) -> str:
        """The directory of the task's prepared splits and their ``info.json``."""
        return self._in(PREPARED)

    @property
    def text(self) -> str:
        """The task's text splits before tokenization."""
        return f"{self.prepared}/text"

    @property
    def partitions(self) -> str:
        """The directory of the description of the task's client partitions (the clients' own files lie in
        :data:`PARTITIONS`, by global id)."""
        return self._in(PARTITIONS)

    @property
    def partitions_info(self) -> str:
        """The description (``info.json``) of the task's client partitions."""
        return f"{self.partitions}/info.json"

    @property
    def base(self) -> str:
        """The base model of the task: the shared body with the task's own head."""
        return f"{self._in('models/base')}/base.safetensors"

    @property
    def centralized(self) -> str:
        """The centralized model (single-task), or the task's view of the ceiling: the body trained jointly on
        every task, with this task's head."""
        return f"{self._in('models/centralized')}/centralized.safetensors"

    def merged_checkpoint(self, name: str) -> str:
        """One merge's model (the merged body with the task's own head)."""
        return f"{self._in(MERGED)}/{name}.safetensors"

    def candidate_checkpoint(self, name: str, candidate: str) -> str:
        """One candidate of a searched merge."""
        return f"{self._in(MERGED)}/{name}.candidates/{candidate}.safetensors"

    def global_checkpoint(self, name: str, round_index: int) -> str:
        """A federated algorithm's model after ``round_index`` rounds (the global body with the task's head)."""
        return f"{self._in(_round_dir(name, round_index))}/global.safetensors"

    @property
    def evaluation(self) -> str:
        """The test metrics of every model on the task (the single-task run: the whole report)."""
        return METRICS if self.task is None else f"{TASK_METRICS}/{self.task}/evaluate.json"


SINGLE_TASK = TaskPaths()
