"""The params schema: ``params.yaml`` validated before any work, plus ``-S key=value`` overrides.

Every section is a pydantic model with ``extra="forbid"``, so a misspelt key is an error
that names it. Stages read whole sections; their names double as DVC ``params:`` entries.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from mergeflow.device import device_setting_problem
from mergeflow.errors import ConfigError, closest, did_you_mean, first_problem
from mergeflow.schema.data_source import Modality
from mergeflow.schema.deprecation import deprecated
from mergeflow.schema.families import DECLARED as FAMILY_DECLARATIONS
from mergeflow.schema.families import FamilyDeclaration, family_of_arch
from mergeflow.schema.federated import (
    AggregatorOptions,
    AttackOptions,
    DPOptions,
    ServerOptimizerOptions,
    participants_per_round,
)
from mergeflow.schema.sources import SOURCES, DataSource, canonical_name


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizerConfig(_Section):
    """Tokenization of text sources. A pretrained model (``model.transformers.pretrained``) brings its own
    tokenizer; otherwise a byte-level BPE tokenizer of ``vocab_size`` is trained on the training
    split (``tokenizers``' WordPiece trainer is not reproducible run to run). Inputs are cut or
    padded to ``max_length`` tokens."""

    kind: Literal["bpe"] = "bpe"
    vocab_size: int = Field(8192, ge=100)
    min_frequency: int = Field(2, ge=1)
    max_length: int = Field(64, ge=1)


class DataConfig(_Section):
    """The data source (``source``, any registered one: :mod:`mergeflow.schema.sources`), its splits and
    feature policies. A source's options are the section ``data.<name>``, validated by its options model;
    the chosen source's (its defaults when left out) is :attr:`options`. Other sources' sections are kept
    only where given, so registering a source changes no params."""

    model_config = ConfigDict(extra="allow")  # the sources' sections, each checked by _source_sections
    source: str = "digits"
    test_fraction: float = Field(0.2, gt=0, lt=1)
    server_fraction: float = Field(0.1, ge=0, lt=1)
    validation_fraction: float = Field(0.0, ge=0, lt=1)
    standardize: Literal["auto", True, False] = "auto"
    categorical: Literal["error", "onehot"] = "error"
    missing: Literal["error", "drop_rows", "mean"] = "error"
    tokenizer: TokenizerConfig = TokenizerConfig()

    @model_validator(mode="before")
    @classmethod
    def _source_sections(cls, raw: Any) -> Any:
        """Old names to new ones (an old section's keys over the new one's), unknown keys refused, and the
        chosen source's section and every one given as its options model."""
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        if isinstance(raw.get("source"), str) and raw["source"] in SOURCES.aliases:
            raw["source"] = canonical_name(raw["source"])
        for old in [key for key in raw if key in SOURCES.aliases]:
            new, section = canonical_name(old), raw.pop(old)
            if isinstance(section, dict) and isinstance(raw.get(new), dict):
                section = raw[new] | section  # `-S data.hf.path=…` over a params file that says data.table
            raw[new] = section
        for key in raw:
            if key not in cls.model_fields and key not in SOURCES:
                raise ValueError(f"{key}: unknown key")
        chosen = raw.get("source", cls.model_fields["source"].default)
        return raw | {name: source.parse(raw.get(name)) for name, source in SOURCES.items() if name in (*raw, chosen)}

    def for_prepare(self) -> dict[str, Any]:
        """The section as the prepare step reads it, as JSON: the chosen source's options, the split fractions
        and, unless the source is text (tokenized, not encoded), the feature policies; no other source's
        options and no tokenizer (the tokenize step's)."""
        unread = {"tokenizer", *(name for name in SOURCES if name != self.source)}
        if self.is_text:
            unread |= {"standardize", "categorical", "missing"}
        return self.model_dump(mode="json", exclude=unread)

    @property
    def spec(self) -> DataSource:
        """The chosen source (its declaration and loaders)."""
        return SOURCES[self.source]

    @property
    def options(self) -> BaseModel:
        """The chosen source's options (section ``data.<source>``)."""
        return getattr(self, self.source)

    @property
    def task(self) -> str:
        """What the labels are: ``classification`` or ``regression``, as the source says for its options."""
        return self.spec.task(self.options)

    @property
    def modality(self) -> Modality:
        """What a row is: ``features``, ``image`` (image-shaped features) or ``tokens`` (tokenized text)."""
        return self.spec.modality(self.options)

    @property
    def is_text(self) -> bool:
        """Whether the source is text (tokenized before partitioning)."""
        return self.modality == "tokens"

    @property
    def group_column(self) -> str | None:
        """The column that names each row's group, if the source has one."""
        return self.spec.group_column(self.options)

    @field_validator("source")
    @classmethod
    def _registered(cls, source: str) -> str:
        if source not in SOURCES:
            raise ValueError(
                f"unknown data source {source!r}{did_you_mean(source, SOURCES)}; known: {', '.join(SOURCES)}"
            )
        return source

    @model_validator(mode="after")
    def _fractions_leave_training_data(self) -> DataConfig:
        if self.test_fraction + self.server_fraction + self.validation_fraction >= 0.95:
            raise ValueError(
                "test_fraction + server_fraction + validation_fraction must leave at least 5% for the clients"
            )
        self.spec.check_options(self.options)
        if self.is_text and self.standardize is True:
            raise ValueError("standardize: text is tokenized, not standardized; set it to auto or false")
        return self


class PartitionConfig(_Section):
    method: Literal["iid", "dirichlet", "pathological", "natural"] = "dirichlet"
    num_clients: int = Field(4, ge=1)
    alpha: float = Field(0.5, gt=0)
    classes_per_client: int = Field(2, ge=1)
    min_partition_size: int = Field(10, ge=0)


class _ModelSection(_Section):
    """The model: ``arch`` names a member of a registered family (:mod:`mergeflow.schema.families`)."""

    arch: str = "mlp"

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, raw: Any) -> Any:
        """A family's old name (``hf``) as ``model.arch`` or as its section, with a one-line notice; an
        old section's keys go over the new one's (``-S model.hf.pretrained=…`` over a file that says
        ``model.transformers``)."""
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        for family in FAMILY_DECLARATIONS.values():
            for old in family.aliases:
                notice = f"model.arch {old!r} is now {family.archs[0]!r} (and model.{old} is model.{family.name})"
                if raw.get("arch") == old:
                    raw["arch"] = family.archs[0]
                    deprecated(notice)
                if old in raw:
                    section = raw.pop(old)
                    if isinstance(section, dict) and isinstance(raw.get(family.name), dict):
                        section = raw[family.name] | section
                    raw[family.name] = section
                    deprecated(notice)
        return raw

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, arch: str) -> str:
        try:
            family_of_arch(arch)
        except ConfigError as error:
            raise ValueError(str(error).removeprefix("model.arch: ")) from None
        return arch

    @property
    def family(self) -> FamilyDeclaration:
        """The declaration of the family that builds ``arch``."""
        return family_of_arch(self.arch)

    @property
    def options(self) -> BaseModel:
        """The chosen family's options (section ``model.<family>``, or keys of ``model`` itself)."""
        return self.family.options(self)


def _model_config() -> type[_ModelSection]:
    """The ``model`` section: ``arch``, the keys of a family declared with ``inline_options`` (the MLPs'
    ``widths``), and a section ``model.<name>`` per other family with options, each its ``Options``."""
    inline = tuple(family.Options for family in FAMILY_DECLARATIONS.values() if family.inline_options)
    sections = {
        family.name: (family.Options, family.Options())
        for family in FAMILY_DECLARATIONS.values()
        if not family.inline_options and family.Options.model_fields
    }
    # The inline options' classes first: pydantic orders the fields from the last base, so ``arch`` leads.
    return create_model(
        "ModelConfig", __base__=(*inline, _ModelSection), __module__=__name__, __doc__=_ModelSection.__doc__, **sections
    )


ModelConfig = _model_config()


class TrainOverride(_Section):
    """Per-client changes to the fine-tuning defaults (as the SSF paper varies epochs and lr)."""

    epochs: int | None = Field(None, ge=0)
    lr: float | None = Field(None, gt=0)
    optimizer: Literal["sgd", "adam"] | None = None
    momentum: float | None = Field(None, ge=0, lt=1)
    weight_decay: float | None = Field(None, ge=0)
    batch_size: int | None = Field(None, ge=1)


class TrainConfig(_Section):
    epochs: int = Field(5, ge=0)
    lr: float = Field(0.05, gt=0)
    optimizer: Literal["sgd", "adam"] = "sgd"
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    batch_size: int = Field(32, ge=1)

    def with_override(self, override: TrainOverride | None) -> TrainConfig:
        """These settings with a client's overrides applied."""
        if override is None:
            return self
        changes = override.model_dump(exclude_none=True)
        return self.model_copy(update=changes)


class LanguageModelPretraining(_Section):
    """Language-model pre-training of a transformer's body before it learns the task: ``mlm`` (masked,
    BERT-style) or ``clm`` (next token, GPT-style); ``auto`` picks by architecture. ``text: server``
    uses the server split's text; ``train`` adds the clients' training text, unlabelled: a
    centralised step federated learning would not allow, to stand in for a public pretrained model;
    ``corpus`` uses the source's own unlabelled corpus instead (``data.wordnet.corpus_examples``),
    text outside the task, as a public model's pre-training corpus is."""

    objective: Literal["auto", "mlm", "clm"] = "auto"
    text: Literal["server", "train", "corpus"] = "server"
    epochs: int = Field(1, ge=1)
    lr: float = Field(5e-4, gt=0)
    batch_size: int = Field(32, ge=1)
    mask_probability: float = Field(0.15, gt=0, lt=1)


class PretrainConfig(TrainConfig):
    """Training of the shared base model on the server split (or random init when disabled); for
    transformers, optionally language-model pre-training first (``language_model``)."""

    enabled: bool = True
    epochs: int = Field(20, ge=0)
    language_model: LanguageModelPretraining | None = None


class LoraSettings(_Section):
    """LoRA fine-tuning of a transformers model (``model.arch: transformers``) through peft: adapters of rank ``r``
    (scaled by ``alpha``/``r``) on the modules whose names end in ``target_modules``, and the head;
    each client's update is folded into full weights before merging."""

    r: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(["query", "value"], min_length=1)


class FinetuneConfig(TrainConfig):
    """Per-client training. ``init: independent`` starts every client from its own random init
    (seeded per client) instead of the shared base model: the setting where alignment matters.
    A client whose loss or weights become NaN or infinite is recorded as diverged; with
    ``on_divergence: fail`` the pipeline stops there, with ``exclude`` the merges leave it out.
    ``precision``: ``bf16`` or ``fp16`` run the forward pass and loss under autocast (fp16 with a
    gradient scaler), for the clients and the centralized oracle; the weights, the stored
    checkpoints, Fishers and merges keep the model's dtype (float32) and their float64 sums."""

    init: Literal["shared", "independent"] = "shared"
    on_divergence: Literal["fail", "exclude"] = "fail"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    lora: LoraSettings | None = None
    clients: dict[int, TrainOverride] = {}


class CentralizedConfig(_Section):
    """The centralized oracle: every client's data pooled, trained from the base model with the
    fine-tuning settings for ``epochs`` (``finetune.epochs`` when unset). ``keep: best_validation``
    scores the validation split after every epoch and keeps the best epoch's weights (the
    parameter-averaging-laws paper compares with the centralized model at its best); it needs
    ``data.validation_fraction`` > 0. Test never chooses."""

    epochs: int | None = Field(None, ge=1)
    keep: Literal["last", "best_validation"] = "last"


class AlignConfig(_Section):
    """Permutation alignment of the client models to a reference before merging (Git Re-Basin).

    ``reference`` is a client id or ``largest`` (the client with the most examples).
    Activation matching uses up to ``examples`` inputs of the server split (else of the
    reference client's data). Loss barriers are measured at ``barrier_points`` on
    ``barrier_examples`` rows of the test split (they cost a forward pass per row, point and client).
    Rows are drawn at random (with ``seed``), not taken from the top: splits may be stored sorted.
    Left unset (null), these three take the model family's defaults: 512, 11 and 1024 for MLPs and
    CNNs; 256, 5 and 256 for transformers (MLP units, whole attention heads and the residual stream
    of BERT- and GPT-2-style models are permuted).

    ``repair`` (MLP/CNN, with ``method`` weights or activations): REPAIR (Jordan et al. 2022) along
    each barrier's path: every interpolated model's units are rescaled so that each unit's mean and
    standard deviation (after its layer, or after the norm that follows it) are the interpolation of
    the two endpoints' statistics, measured on up to ``examples`` rows of the two clients' training
    data; the barriers are reported with and without it.
    """

    method: Literal["none", "weights", "activations"] = "none"
    reference: int | Literal["largest"] = "largest"
    metric: Literal["correlation", "l2"] = "correlation"
    max_iter: int = Field(100, ge=1)
    examples: int | None = Field(None, ge=1)
    barrier_points: int | None = Field(None, ge=3)
    barrier_examples: int | None = Field(None, ge=1)
    repair: bool = False


class FisherConfig(_Section):
    """Per-client Fisher estimation: diagonal always, factors F ≈ UᵀU when ``low_rank``.

    The factors are the per-example scores of ``rank_examples`` examples, or, with
    ``factor_memory_mb``, a Frequent Directions sketch of the scores of all ``n_examples`` examples
    in about that much memory (its rows: the budget over 12 bytes per parameter).
    """

    kind: Literal["empirical", "sampled", "exact"] = "exact"
    n_examples: int = Field(1024, ge=1)
    batch_size: int = Field(256, ge=1)
    low_rank: bool = False
    rank_examples: int = Field(64, ge=1)
    factor_memory_mb: float | None = Field(None, gt=0)
    backend: Literal["auto", "backpack", "functorch"] = "auto"


def _resolve_variant(options: dict[str, dict[str, Any]], name: str, kind_key: str) -> tuple[str, dict[str, Any]]:
    """A list entry's registered name and options: ``name`` itself, or a variant with a ``kind_key``."""
    chosen = dict(options.get(name, {}))
    return str(chosen.pop(kind_key, name)), chosen


def _check_variants(
    entries: list[str],
    options: dict[str, dict[str, Any]],
    *,
    list_key: str,
    kind_key: str,
    known: dict[str, Any],
    validate: Any,
    error_prefix: str,
) -> None:
    """Every listed entry is registered or a declared variant; every option set validates.

    Shared by ``merge.methods`` and ``federated.algorithms``; raises ValueError naming the key.
    ``known`` is the torch-free schema (``mergeflow.schema``), so validating imports no torch.
    """
    for name, chosen in options.items():
        kind = chosen.get(kind_key, name)
        if kind not in known:
            key = f"options.{name}.{kind_key}" if kind_key in chosen else f"options.{name}"
            raise ValueError(
                f"{key}: unknown {kind_key} {kind!r}{did_you_mean(kind, known)}; known: {', '.join(known)}"
            )
        try:
            validate(kind, _resolve_variant(options, name, kind_key)[1])
        except ConfigError as error:
            detail = error.lines[0].removeprefix(f"{error_prefix}.{kind}.")
            raise ValueError(f"options.{name}.{detail}") from None
    for i, name in enumerate(entries):
        if name not in known and name not in options:
            raise ValueError(
                f"{list_key}[{i}]: unknown {kind_key} {name!r}{did_you_mean(name, [*known, *options])}; "
                f"known: {', '.join(known)} "
                f"(or declare a variant under {error_prefix} with a '{kind_key}' key)"
            )
    if len(set(entries)) != len(entries):
        raise ValueError(f"{list_key}: an entry is listed twice")


class MergeConfig(_Section):
    """The merges to run. Each name in ``methods`` is a registered method, or a variant
    declared in ``options`` with a ``method`` key (e.g. ``ssf_20: {method: ssf, mask_rate: 0.2}``),
    so one method can run with several settings side by side.
    """

    methods: list[str] = ["average", "weighted", "task_arithmetic"]
    options: dict[str, dict[str, Any]] = {}
    select_by: Literal["auto", "accuracy", "nll", "mse"] = "auto"
    # Tensor-scope merges of client checkpoints larger than this stream from the files, tensor by tensor
    # (mergeflow.merge.streaming), never holding the K models; 0 streams always. Same result either way.
    stream_above_mb: float = Field(256, ge=0)

    def resolve(self, name: str) -> tuple[str, dict[str, Any]]:
        """The registered method and its options for one entry of ``methods``."""
        return _resolve_variant(self.options, name, "method")

    def selection_metric(self, task: str) -> str:
        """The validation metric searches are chosen by: ``select_by``, or accuracy (classification) / NLL."""
        from mergeflow.schema.objectives import declared_objective

        return self.select_by if self.select_by != "auto" else declared_objective(task).select_by[0]

    @model_validator(mode="after")
    def _known_methods_and_options(self) -> MergeConfig:
        from mergeflow.schema.merge import DECLARED, validate_options
        from mergeflow.schema.search import search_grid

        def validate_search(method: str, options: dict[str, Any]) -> None:
            for candidate in search_grid(options, prefix=f"merge.options.{method}."):
                validate_options(method, candidate)

        _check_variants(
            self.methods,
            self.options,
            list_key="methods",
            kind_key="method",
            known=DECLARED,
            validate=validate_search,
            error_prefix="merge.options",
        )
        return self


class LocalTrainConfig(TrainConfig):
    epochs: int = Field(2, ge=1)


_ENTRY_SECTIONS = {"server": ServerOptimizerOptions, "aggregator": AggregatorOptions}


class FederatedConfig(_Section):
    """Federated rounds beside the one-shot merges, each algorithm from the base model.

    Each name in ``algorithms`` is a registered algorithm, or a variant declared in ``options``
    with an ``algorithm`` key (e.g. ``fedprox_01: {algorithm: fedprox, mu: 0.1}``). An entry's
    ``local`` key changes the local training for that entry only (e.g. ``fedavg_adam: {algorithm:
    fedavg, local: {optimizer: adam, lr: 0.001}}``).
    ``fraction`` of the clients (at least one) take part in each round, sampled with the seed.
    A client whose local training diverges is recorded; ``on_divergence: fail`` then stops the
    run, ``exclude`` drops its message for that round (its state is kept). Gaussian global models
    (Bayes-ADMM) are also scored by their Monte-Carlo predictive with ``predictive_samples``
    draws (0 = off), as ``bma_*`` metrics beside those of the mean.
    ``exchange: adapters`` (transformers with ``finetune.lora``): clients train and send only LoRA
    adapters and the head; the body stays the base model's, and the global model folds the global
    adapters in (W + B̄·Ā). ``full`` trains and sends every parameter.
    ``server`` (a server optimizer: FedAvgM, FedAdam, FedYogi, FedAdagrad) and ``aggregator`` (a
    Byzantine-robust rule) apply to every entry, or to one entry under its own ``server`` /
    ``aggregator`` key; ``attack`` makes some clients Byzantine; ``dp`` runs client-level DP
    (DP-FedAvg) with Poisson-sampled participants (see :mod:`mergeflow.schema.federated`).
    """

    algorithms: list[str] = []
    rounds: int = Field(10, ge=1)
    fraction: float = Field(1.0, gt=0, le=1)
    exchange: Literal["full", "adapters"] = "full"
    on_divergence: Literal["fail", "exclude"] = "fail"
    predictive_samples: int = Field(32, ge=0)
    local: LocalTrainConfig = LocalTrainConfig()
    server: ServerOptimizerOptions = ServerOptimizerOptions()
    aggregator: AggregatorOptions = AggregatorOptions()
    attack: AttackOptions | None = None
    dp: DPOptions | None = None
    options: dict[str, dict[str, Any]] = {}

    def resolve(self, name: str) -> tuple[str, dict[str, Any]]:
        """The registered algorithm and its options for one entry of ``algorithms``."""
        algorithm, options = _resolve_variant(self.options, name, "algorithm")
        for key in _ENTRY_SECTIONS:
            options.pop(key, None)
        return algorithm, options

    def server_for(self, name: str) -> ServerOptimizerOptions:
        """The server optimizer of one entry: its own ``server``, else the section's."""
        own = self.options.get(name, {}).get("server")
        return self.server if own is None else ServerOptimizerOptions.model_validate(own)

    def aggregator_for(self, name: str) -> AggregatorOptions:
        """The aggregator of one entry: its own ``aggregator``, else the section's."""
        own = self.options.get(name, {}).get("aggregator")
        return self.aggregator if own is None else AggregatorOptions.model_validate(own)

    def local_for(self, name: str) -> LocalTrainConfig:
        """The local training of one entry: ``local`` with the entry's own ``local`` changes."""
        changes = TrainOverride.model_validate(self.options.get(name, {}).get("local", {}))
        return self.local.with_override(changes)

    @model_validator(mode="after")
    def _known_algorithms_and_options(self) -> FederatedConfig:
        from mergeflow.schema.federated import ALGORITHMS, validate_options

        for name, chosen in self.options.items():
            for key, model in (("local", TrainOverride), *_ENTRY_SECTIONS.items()):
                try:
                    model.model_validate(chosen.get(key, {}))
                except ValidationError as error:
                    raise ValueError(first_problem(f"options.{name}.{key}", error)) from None
        _check_variants(
            self.algorithms,
            {
                name: {k: v for k, v in chosen.items() if k != "local" and k not in _ENTRY_SECTIONS}
                for name, chosen in self.options.items()
            },
            list_key="algorithms",
            kind_key="algorithm",
            known=ALGORITHMS,
            validate=validate_options,
            error_prefix="federated.options",
        )
        return self


class EvaluateConfig(_Section):
    ece_bins: int = Field(15, ge=1)
    batch_size: int = Field(1024, ge=1)
    noise_std: float = Field(1.0, gt=0)


class OrchestrationConfig(_Section):
    """Where per-client and per-round tasks run.

    ``threads``: a thread pool of ``max_workers`` in this process. ``dask``: a Dask cluster
    through prefect-dask: the cluster at ``dask_address`` (e.g. ``tcp://scheduler:8786``, whose
    workers must see the project directory at the same path), or a LocalCluster of
    ``dask_workers`` single-threaded processes. Every step runs torch with ``torch_threads``
    intra-op threads, whatever the runner: float reductions then add up in the same order,
    so threads and Dask give bit-identical weights. ``steps_per_task`` > 1 runs that many
    uncached steps (e.g. clients of a round) in one Prefect task run: less orchestration per
    step when steps take milliseconds, while each step is still cached, and resumed, on its own.
    ``auto`` runs a wave's uncached steps in one task run when the stage's steps so far took
    under half a second each (a federated round of small models: threads would only contend for
    the GIL), and otherwise splits them into one task run per worker (``max_workers`` threads, or
    ``dask_workers``), so the workers stay busy and a wave costs a few task runs. A stage of waves
    (federated rounds) starts as one chain of its waves in one task run, keying each wave after the
    one before it is in place, and goes on wave by wave once its steps turn out long
    (:func:`tasks.scheduling.runs_waves_together`).

    ``device``: where steps that compute (training, Fisher, alignment, merges, federated rounds,
    evaluation) run: ``auto`` (CUDA when torch sees a GPU, else the CPU), ``cpu``, ``cuda``,
    ``cuda:N`` or ``mps``. It is not part of a step's cache key (a result does not depend on the
    device beyond rounding): each step record and MLflow run notes the device that made it, and a
    run whose results come from more than one device says so. ``gpu_workers``: at most this many
    steps use the GPU at once in this process (threads); on Dask, steps that compute ask for a
    ``GPU`` worker resource when the device is a GPU (``dask worker --resources GPU=1``).
    """

    task_runner: Literal["threads", "dask"] = "threads"
    max_workers: int = Field(1, ge=1)
    torch_threads: int = Field(1, ge=1)
    steps_per_task: int | Literal["auto"] = Field("auto")
    dask_address: str | None = None
    dask_workers: int = Field(2, ge=1)
    device: str = "auto"
    gpu_workers: int = Field(1, ge=1)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        problem = device_setting_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("steps_per_task")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be 'auto' or at least 1")
        return value


class TrackingConfig(_Section):
    experiment: str = "mergeflow"
    log_models: bool = True


class Params(_Section):
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

    @property
    def pretrained(self) -> str | None:
        """The pretrained model the model family starts from (a directory or hub name), if any."""
        key = self.model.family.pretrained_key
        return self.section(key) if key else None

    @property
    def task(self) -> str:
        """The objective the models learn: the one the model family's options choose (a causal LM), else
        the data's task."""
        return self.model.family.objective(self.model.options) or self.data.task

    @property
    def model_members(self) -> tuple[str, ...]:
        """The modules of the model family and of the objective the run's models use: the members
        (:attr:`tasks.steps.Step.members`) of the steps that build, train or score them."""
        from mergeflow.schema.objectives import declared_objective

        return tuple(m for m in (self.model.family.module, declared_objective(self.task).module) if m)

    @model_validator(mode="after")
    def _cross_checks(self) -> Params:
        for cid in self.finetune.clients:
            if not 0 <= cid < self.partition.num_clients:
                raise ValueError(
                    f"finetune.clients.{cid}: no such client (partition.num_clients is {self.partition.num_clients})"
                )
        reference = self.align.reference
        if isinstance(reference, int) and not 0 <= reference < self.partition.num_clients:
            raise ValueError(
                f"align.reference: no client {reference} (partition.num_clients is {self.partition.num_clients})"
            )
        if self.partition.method == "natural" and not self.data.group_column:
            where = f"data.{self.data.source}.group_column"
            raise ValueError(f"partition.method: 'natural' needs a group column; set {where}")
        regression = self.data.task == "regression"
        self._check_federated()
        self._check_objective()
        self._check_family()
        if regression and self.partition.method in ("dirichlet", "pathological"):
            raise ValueError(
                f"partition.method: {self.partition.method!r} skews class labels, and the data is a regression "
                "task; use iid or natural"
            )
        if self.federated.exchange == "adapters" and self.finetune.lora is None:
            raise ValueError("federated.exchange: 'adapters' exchanges LoRA adapters; set finetune.lora (r, alpha, …)")
        if self.pretrain.enabled and self.data.server_fraction == 0:
            raise ValueError(
                "pretrain.enabled: pre-training needs a server split; set data.server_fraction > 0 "
                "or pretrain.enabled: false for a shared random init"
            )
        if self.centralized.keep == "best_validation" and self.data.validation_fraction == 0:
            raise ValueError(
                "centralized.keep: best_validation chooses the epoch on the validation split; "
                "set data.validation_fraction > 0"
            )
        language_model = self.pretrain.language_model
        if language_model and language_model.text == "corpus":
            if self.data.spec.corpus_size(self.data.options) == 0:
                raise ValueError(
                    "pretrain.language_model.text: corpus needs a source with an unlabelled corpus "
                    f"(e.g. data.wordnet.corpus_examples > 0), and data.source {self.data.source!r} gives none"
                )
        if self.centralized.keep == "best_validation" and self.finetune.lora:
            raise ValueError("centralized.keep: best_validation does not support finetune.lora yet; use keep: last")
        from mergeflow.schema.merge import DECLARED
        from mergeflow.schema.search import searched_keys

        for name in self.merge.methods:
            method, options = self.merge.resolve(name)
            if "scorer" in DECLARED[method].needs and self.data.validation_fraction == 0:
                raise ValueError(
                    f"merge.methods: {name!r} chooses on the validation split; set data.validation_fraction > 0"
                )
            searched = searched_keys(options)
            if searched and self.data.validation_fraction == 0:
                raise ValueError(
                    f"merge.options.{name}.{searched[0]}: a list is a search, chosen on the validation split; "
                    "set data.validation_fraction > 0"
                )
            count_problem = DECLARED[method].model_count_problem(self.partition.num_clients)
            if count_problem:
                raise ValueError(
                    f"merge.methods: {name!r} ({method}) {count_problem}, and partition.num_clients is "
                    f"{self.partition.num_clients}"
                )
            if "factors" in DECLARED[method].needs and not self.fisher.low_rank:
                raise ValueError(f"fisher.low_rank: merge method {name!r} needs Fisher factors; set it to true")
        rows = _known_training_rows(self.data)
        if rows is not None and self.partition.num_clients > rows:
            raise ValueError(
                f"partition.num_clients: {self.partition.num_clients} clients but only {rows} training samples"
            )
        return self

    def _check_federated(self) -> None:
        """Server optimizers, aggregators, attacks and DP: what each entry's maths allows, and sizes."""
        from mergeflow.schema.federated import ALGORITHMS

        federated, clients = self.federated, self.partition.num_clients
        attack, dp = federated.attack, federated.dp
        if attack is not None and attack.clients > clients:
            raise ValueError(
                f"federated.attack.clients: {attack.clients} attackers but partition.num_clients is {clients}"
            )
        if attack is not None and attack.poisons_data and self.task != "classification":
            raise ValueError(f"federated.attack.kind: label_flip flips class labels, and the task is {self.task}")
        n = participants_per_round(clients, federated.fraction)
        for name in federated.algorithms:
            algorithm = federated.resolve(name)[0]
            declared = ALGORITHMS[algorithm]
            server, aggregator = federated.server_for(name), federated.aggregator_for(name)
            if not server.is_identity and not declared.point_estimate:
                raise ValueError(
                    f"federated.server: {name!r} ({algorithm}) has no point-estimate global model to step on "
                    "(its server step is in natural parameters); use optimizer: sgd, lr: 1"
                )
            averages = declared.averages_messages
            if not aggregator.is_identity and not averages:
                raise ValueError(
                    f"federated.aggregator: {name!r} ({algorithm}) does not average the clients' messages "
                    "(its server step sums duals or natural parameters); use name: mean"
                )
            if dp is not None and not averages:
                raise ValueError(f"federated.dp: DP-FedAvg replaces an averaging server step; {name!r} is {algorithm}")
            if dp is not None and not aggregator.is_identity:
                raise ValueError(f"federated.aggregator: {name!r}: DP-FedAvg's noised sum needs name: mean")
            if problem := aggregator.check_participants(n):
                raise ValueError(problem)
        if dp is not None:
            from mergeflow.accounting import check_dp

            if problem := check_dp(dp, clients, federated.fraction, federated.rounds):
                raise ValueError(problem)

    def _check_objective(self) -> None:
        """The objective's own rules: the metrics it selects on, its Fisher kinds, language-model pre-training."""
        from mergeflow.schema.objectives import declared_objective

        objective = declared_objective(self.task)
        if self.merge.select_by not in ("auto", *objective.select_by):
            raise ValueError(
                f"merge.select_by: {self.merge.select_by} does not apply to a {self.task} task; "
                f"use {' or '.join(objective.select_by)}"
            )
        if self.fisher.kind not in objective.fisher_kinds:
            raise ValueError(
                f"fisher.kind: {self.fisher.kind!r} is not a Fisher of a {self.task} task (for a causal LM, 'exact' "
                f"would sum over every vocabulary token at every position); use {' or '.join(objective.fisher_kinds)}"
            )
        if objective.trains_language_model and self.pretrain.language_model is not None:
            raise ValueError(
                f"pretrain.language_model: with a {self.task} task the pretrain step already trains the "
                "language model on the server split; remove it"
            )

    def _check_family(self) -> None:
        """What the model family supports: its inputs, alignment, BackPACK, language models, its own rules."""
        family = self.model.family
        if (family.inputs == "tokens") != self.data.is_text:
            raise ValueError(
                f"model.arch: {self.model.arch!r} takes {family.inputs}, and data.source {self.data.source!r} "
                f"{'is' if self.data.is_text else 'is not'} text; text sources need model.arch: transformers"
            )
        if not family.aligns and self.align.method != "none":
            raise ValueError(
                f"align.method: permutation alignment of {family.name} models is not implemented; set it to none"
            )
        if self.align.repair and self.align.method == "none":
            raise ValueError("align.repair: REPAIR rescales aligned models; set align.method to weights or activations")
        if self.align.repair and not family.repairs:
            raise ValueError(f"align.repair: REPAIR is implemented for MLP/CNN models, not {family.name} models")
        for key, value in family.align_defaults.items():
            if getattr(self.align, key) is None:
                setattr(self.align, key, value)  # what the steps read, resolved once
        if not family.backpack and self.fisher.backend == "backpack":
            raise ValueError(f"fisher.backend: BackPACK does not cover {family.name} modules; use auto or functorch")
        if not family.language_models and self.pretrain.language_model is not None:
            raise ValueError("pretrain.language_model: language-model pre-training needs model.arch: transformers")
        if not family.language_models and self.finetune.lora is not None:
            raise ValueError("finetune.lora: LoRA needs a transformers model (model.arch: transformers)")
        family.check(self)

    def section(self, dotted: str) -> Any:
        """A section or key as plain JSON data, e.g. ``section("finetune")``."""
        value: Any = self.model_dump(mode="json")
        for part in dotted.split("."):
            value = value[part]
        return value


def _known_training_rows(data: DataConfig) -> int | None:
    total = data.spec.known_rows(data.options)
    if total is None:
        return None
    return int(total * (1 - data.test_fraction - data.server_fraction - data.validation_fraction))


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``a.b=value``; the value is parsed with YAML rules, as ``dvc exp run -S`` does."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError([f"-S {text}: expected KEY=VALUE, e.g. -S merge.methods=[average]"])
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of ``raw`` with each ``key=value`` override set at its dotted path."""
    result = copy.deepcopy(raw)
    for text in overrides:
        key, value = parse_override(text)
        node = result
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError([f"-S {text}: {part} is not a section"])
            node = child
        node[parts[-1]] = value
    return result


def _error_lines(
    error: ValidationError, source: str, raw: dict[str, Any], overrides: list[str] | None = None
) -> list[str]:
    """One line per problem, each naming where its key was given: ``source``, or the ``-S`` override that set it."""
    lines = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        subkey = re.match(r"^([\w.\[\]]+): (.*)$", message)
        if subkey:  # a validator that names the exact key below its section
            key = f"{key}.{subkey.group(1)}" if key else subkey.group(1)
            message = subkey.group(2)
        if item["type"] == "extra_forbidden":
            message = "unknown key"
        if message == "unknown key":
            message += _suggested_key(key.split("."), raw)
        scalar = not isinstance(item["input"], dict | list) and item["type"] != "extra_forbidden"
        shown = f" (got {json.dumps(item['input'], default=str)})" if scalar else ""
        where = f"{key}: " if key else ""
        lines.append(f"{_given_by(key, overrides or []) or source}: {where}{message}{shown}")
    return lines


def _given_by(key: str, overrides: list[str]) -> str | None:
    """``-S a.b=v``: the last override that set ``key``, a section above it, or a key below it; None for none."""
    parts = re.sub(r"\[\d+\]", "", key).split(".") if key else []  # merge.methods[0] was given as merge.methods
    for text in reversed(overrides):
        given = text.partition("=")[0].strip().split(".")
        shared = min(len(given), len(parts))
        if parts and given[:shared] == parts[:shared]:
            return f"-S {text}"
    return None


def _suggested_key(parts: list[str], raw: dict[str, Any]) -> str:
    """``; did you mean a.b.c?`` for the known key beside an unknown one that it most looks like."""
    match = closest(parts[-1], _keys_below(parts[:-1], raw))
    return f"; did you mean {'.'.join([*parts[:-1], match])}?" if match else ""


def _keys_below(parts: list[str], raw: Any) -> list[str]:
    """The keys the schema allows right below the dotted key ``parts`` ([] where it cannot tell): the fields
    of the section's model, a data source's options, or a merge or federated entry's options by its kind."""
    for kinds, kind_key, extra in (
        ("merge", "method", ("method",)),
        ("federated", "algorithm", ("algorithm", "local")),
    ):
        if len(parts) == 3 and parts[:2] == [kinds, "options"]:
            entry = _raw_at(raw, parts)
            kind = entry.get(kind_key, parts[2]) if isinstance(entry, dict) else parts[2]
            declared = _declared_options(kinds)
            return [*extra, *declared[kind].model_fields] if kind in declared else list(extra)
    if parts == ["data"]:
        return [*DataConfig.model_fields, *SOURCES]
    if len(parts) == 2 and parts[0] == "data" and parts[1] in (*SOURCES, *SOURCES.aliases):
        return list(SOURCES[SOURCES.aliases.get(parts[1], parts[1])].Options.model_fields)
    if len(parts) == 4 and parts[:2] == ["federated", "options"] and parts[3] == "local":
        return list(TrainOverride.model_fields)
    node: Any = Params
    for part in parts:
        node = _child_type(node, part)
    return next((list(option.model_fields) for option in _members(node) if _is_model(option)), [])


def _child_type(annotation: Any, part: str) -> Any:
    """The type of ``part`` below a value of type ``annotation`` (a model's field, a dict's or list's item)."""
    for option in _members(annotation):
        if _is_model(option):
            field = option.model_fields.get(part)
            return field.annotation if field else None
        if get_origin(option) in (dict, list):
            return get_args(option)[-1]
    return None


def _members(annotation: Any) -> tuple[Any, ...]:
    """The types of a union (``X | None``), or the one type."""
    return get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _raw_at(raw: Any, parts: list[str]) -> Any:
    for part in parts:
        raw = raw.get(part) if isinstance(raw, dict) else None
    return raw


def _declared_options(kinds: str) -> dict[str, type[BaseModel]]:
    """The options model of each declared merge method (``kinds`` merge) or federated algorithm."""
    if kinds == "merge":
        from mergeflow.schema.merge import DECLARED

        return {name: declaration.Options for name, declaration in DECLARED.items()}
    from mergeflow.schema.federated import ALGORITHMS

    return {name: declaration.Options for name, declaration in ALGORITHMS.items()}


def validate_params(raw: dict[str, Any], source: str = "params", overrides: list[str] | None = None) -> Params:
    """Validate a raw params mapping; raise ConfigError with one line per problem. A problem with a key that one
    of ``overrides`` (``-S`` texts, already applied to ``raw``) set names that override instead of ``source``."""
    if not isinstance(raw, dict):
        raise ConfigError([f"{source}: expected a mapping of sections at the top level"])
    try:
        return Params.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(_error_lines(error, source, raw, overrides)) from None


def load_params(path: str | Path = "params.yaml", overrides: list[str] | None = None) -> Params:
    """Read, override and validate a params file. Errors name the file and key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"{path}: params file not found"])
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError([f"{path}: not valid YAML: {error}".replace("\n", " ")]) from None
    return validate_params(apply_overrides(raw, overrides or []), str(path), overrides)
