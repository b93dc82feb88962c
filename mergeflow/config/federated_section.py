"""The ``federated`` section: federated rounds beside the one-shot merges."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from mergeflow.config.entry_variants import check_variants, resolve_variant
from mergeflow.config.section import Section
from mergeflow.config.training_sections import LocalTrainConfig, TrainOverride
from mergeflow.errors import first_problem
from mergeflow.schema.federated import AggregatorOptions, AttackOptions, DPOptions, ServerOptimizerOptions

_ENTRY_SECTIONS = {"server": ServerOptimizerOptions, "aggregator": AggregatorOptions}


class FederatedConfig(Section):
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
    ``heads``: ``shared``: the server aggregates the whole model, head included; ``local`` (FedPer): it
    aggregates the body only, and each client keeps its own head across rounds (from its task's base model's
    head), trained with the body; ``frozen`` (FedBABU): the heads stay at their initialisation during the
    rounds (only the body is trained and aggregated), then each client fine-tunes its head on the final body
    for ``head_epochs`` epochs. ``auto``: local in a multi-task run, else shared (a causal LM has no head). A task's
    model is the global body with its clients' example-weighted average head.
    """

    algorithms: list[str] = []
    rounds: int = Field(10, ge=1)
    fraction: float = Field(1.0, gt=0, le=1)
    exchange: Literal["full", "adapters"] = "full"
    on_divergence: Literal["fail", "exclude"] = "fail"
    heads: Literal["auto", "shared", "local", "frozen"] = "auto"
    head_epochs: int = Field(1, ge=0)
    predictive_samples: int = Field(32, ge=0)
    local: LocalTrainConfig = LocalTrainConfig()
    server: ServerOptimizerOptions = ServerOptimizerOptions()
    aggregator: AggregatorOptions = AggregatorOptions()
    attack: AttackOptions | None = None
    dp: DPOptions | None = None
    options: dict[str, dict[str, Any]] = {}

    def heads_of(self, multitask: bool, has_head: bool = True) -> Literal["shared", "local", "frozen"]:
        """How the run's clients hold their heads: ``heads``, with ``auto`` local in a multi-task run of a model
        with a head (not a causal LM), shared otherwise."""
        if self.heads == "auto":
            return "local" if multitask and has_head else "shared"
        return self.heads

    def algorithm_of(self, name: str) -> str:
        """The registered algorithm of one entry of ``algorithms``."""
        return resolve_variant(self.options, name, "algorithm")[0]

    def resolve(self, name: str) -> tuple[str, BaseModel]:
        """The registered algorithm of one entry of ``algorithms`` and its validated options; the entry's
        ``local``, ``server`` and ``aggregator`` are apart (:meth:`local_for`, :meth:`server_for`,
        :meth:`aggregator_for`)."""
        from mergeflow.schema.federated import validate_options

        algorithm, options = resolve_variant(self.options, name, "algorithm")
        for key in ("local", *_ENTRY_SECTIONS):
            options.pop(key, None)
        return algorithm, validate_options(algorithm, options)

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
        check_variants(
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
