"""The federated axes' declarations: algorithms, aggregators, server optimizers and attacks, and their options.

Torch-free on purpose: validating params imports this module, not the members' code. Each member is one
declaration (a :class:`mergeflow.registry.Member`: its name, options, capability flags and
``implementation``, a ``"module:attr"`` reference) in its axis's registry (:data:`ALGORITHMS`,
:data:`AGGREGATORS`, :data:`SERVER_OPTIMIZERS`, :data:`ATTACKS`); the round code imports the module of
the member it runs and no other, and a federated step is keyed by that module's import closure. A
built-in member is its declaration here plus its implementation; an algorithm of a notebook declares
itself through ``mergeflow.federated.register_algorithm``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mergeflow.errors import ConfigError
from mergeflow.registry import Member, NoOptions, Registry


class FederatedOptions(NoOptions):
    """Base of the federated options models: unknown keys are errors, and a validated model is a value."""

    model_config = ConfigDict(frozen=True)


def _registered(registry: Registry[Any], name: str) -> str:
    """``name``'s registered name in ``registry`` (an alias's, with a deprecation line); ValueError naming the
    known ones, for a pydantic validator, otherwise."""
    try:
        return registry.canonical(name)
    except ConfigError as error:
        raise ValueError(error.lines[0]) from None


@dataclass(frozen=True)
class FederatedMember(Member):
    """A member of a federated axis: its ``name``, ``implementation`` (``"module:attr"``) and older ``aliases``."""

    name: str
    implementation: str
    aliases: tuple[str, ...] = field(default=(), kw_only=True)


# ----------------------------------------------------------------------------- algorithms


@dataclass(frozen=True)
class Algorithm(FederatedMember):
    """A federated algorithm: ``implementation`` names its ``mergeflow.federated.base.FederatedAlgorithm``
    subclass, ``Options`` the model of ``federated.options.<name>``.

    Two flags say which server-side options its maths allows: ``averages_messages``: its server step is an
    average of the clients' ``mean.`` messages (a robust aggregator or DP-FedAvg's clipped, noised average
    may replace it); ``point_estimate``: its global model is a point θ̄ (a server optimizer may step on θ̄'s
    change).
    """

    Options: type[BaseModel] = NoOptions
    averages_messages: bool = False
    point_estimate: bool = False

    def parse(self, options: BaseModel | Mapping[str, Any] | None = None) -> BaseModel:
        """Its validated options (from a mapping, an options model or None for the defaults).

        Raises:
            ConfigError: naming ``federated.options.<name>.<key>``.
        """
        if isinstance(options, self.Options):
            return options
        if isinstance(options, BaseModel):
            options = options.model_dump()
        try:
            return self.Options.model_validate(dict(options or {}))
        except ValidationError as error:
            raise ConfigError.from_validation(f"federated.options.{self.name}", error) from None


class FedAvgOptions(FederatedOptions):
    """``weighting``: ``"size"`` averages with n_k/N over the participants, ``"uniform"`` with 1/|P|."""

    weighting: Literal["size", "uniform"] = "size"


class FedProxOptions(FedAvgOptions):
    """``mu``: weight of the proximal term μ/2·‖θ − θ̄‖² added to the local mean loss."""

    mu: float = Field(0.01, ge=0.0)


class FedADMMOptions(FederatedOptions):
    """``rho``: penalty and dual step ρ; ``prior_precision``: the server's L2 prior precision δ (0: none)."""

    rho: float = Field(1.0, gt=0.0)
    prior_precision: float = Field(0.0, ge=0.0)


class RunawayGuardOptions(FederatedOptions):
    """The run-away check of an algorithm with duals (:func:`mergeflow.federated.divergence.guard_runaway`).

    ``runaway_window`` W, ``runaway_growth`` G: a client whose distance ‖θ_k − θ̄‖ from the model it
    started at is more than G× its smallest distance over its last W rounds (from its third round
    on), G× its first round's and G× the algorithm's own scale has run away; its update is then
    treated as diverged, under ``federated.on_divergence``. W = 0 turns the check off.
    """

    runaway_window: int = Field(10, ge=0)
    runaway_growth: float = Field(10.0, gt=1.0)


class BayesADMMOptions(RunawayGuardOptions):
    """Hyperparameters of Bayes-ADMM / IVON-ADMM.

    ``rho`` ρ (proximal weight, dual step and server mix), ``damping`` d of the dual step,
    ``temperature`` τ, ``prior_precision`` δ (S0 = δI), ``prior_mean`` m0 (the initial model or 0),
    ``server_step`` α (default 1/(1 + Kρ)); IVON: ``lr`` (not rescaled), ``hess_init`` (used only
    before the first server update), ``beta1``, ``beta2``, ``mc_samples``, ``clip_radius``; and the
    run-away check's ``runaway_window`` and ``runaway_growth``. The defaults are the reference
    configs' scales (τ 1e-3, ``hess_init`` 0.01, lr 0.01, β2 0.999) with ρ 1, chosen on validation
    over 100 rounds for digits MLPs from a pre-trained base (``experiments/bayes_admm_tuning.yaml``,
    docs/results.md); their drift stays bounded over 200 rounds. The earlier defaults (τ 1, lr 0.2,
    ρ 0.3, ``hess_init`` 1) ran away after about 10 rounds: see
    :mod:`mergeflow.federated.flat_direction` for the mechanism and the stable region.
    """

    rho: float = Field(1.0, gt=0.0)
    damping: float = Field(0.1, gt=0.0, le=1.0)
    temperature: float = Field(0.001, gt=0.0)
    prior_precision: float = Field(1.0, gt=0.0)
    prior_mean: Literal["init", "zero"] = "init"
    server_step: float | None = Field(None, gt=0.0, le=1.0)
    lr: float = Field(0.01, gt=0.0)
    hess_init: float = Field(0.01, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.999, ge=0.0, le=1.0)
    mc_samples: int = Field(1, ge=1)
    clip_radius: float = Field(math.inf, gt=0.0)


ALGORITHMS: Registry[Algorithm] = Registry("federated algorithm")
ALGORITHMS.declare(
    Algorithm("fedavg", "mergeflow.federated.fedavg:FedAvg", FedAvgOptions, averages_messages=True, point_estimate=True)
)
ALGORITHMS.declare(
    Algorithm(
        "fedprox", "mergeflow.federated.fedprox:FedProx", FedProxOptions, averages_messages=True, point_estimate=True
    )
)
ALGORITHMS.declare(Algorithm("fedadmm", "mergeflow.federated.fedadmm:FedADMM", FedADMMOptions, point_estimate=True))
ALGORITHMS.declare(Algorithm("bayes_admm", "mergeflow.federated.bayes_admm:BayesADMM", BayesADMMOptions))


def validate_options(name: str, options: BaseModel | Mapping[str, Any] | None = None) -> BaseModel:
    """Validate algorithm ``name``'s options (a mapping, an options model or None for the defaults).

    Raises:
        ConfigError: on an unknown algorithm, or naming the algorithm and the offending key.
    """
    return ALGORITHMS.lookup(name).parse(options)


# ----------------------------------------------------------------------------- server-side members


def participants_per_round(num_clients: int, fraction: float) -> int:
    """How many clients a round samples: ``max(1, round(fraction · K))``, at most K."""
    return min(num_clients, max(1, math.floor(fraction * num_clients + 0.5)))


@dataclass(frozen=True)
class ServerOptimizer(FederatedMember):
    """A server optimizer: ``implementation`` names its step on one parameter,
    ``fn(server, name, target, options, lr) -> entries``: the server state's new entries for parameter
    ``name`` (θ̄ under ``mean.<name>``, and its moments) from the aggregate ``target`` and the step size.
    ``plain_at_unit_lr``: with lr 1 it is plain averaging, so no step runs; ``corrects_bias``: its
    moments take ``bias_correction``.
    """

    plain_at_unit_lr: bool = False
    corrects_bias: bool = False


SERVER_OPTIMIZERS: Registry[ServerOptimizer] = Registry("server optimizer")
_SERVER_OPT = "mergeflow.federated.server_opt"
SERVER_OPTIMIZERS.declare(ServerOptimizer("sgd", f"{_SERVER_OPT}:sgd", plain_at_unit_lr=True))
SERVER_OPTIMIZERS.declare(ServerOptimizer("avgm", f"{_SERVER_OPT}:avgm"))
SERVER_OPTIMIZERS.declare(ServerOptimizer("adagrad", f"{_SERVER_OPT}:adagrad"))
SERVER_OPTIMIZERS.declare(ServerOptimizer("adam", f"{_SERVER_OPT}:adam", corrects_bias=True))
SERVER_OPTIMIZERS.declare(ServerOptimizer("yogi", f"{_SERVER_OPT}:yogi", corrects_bias=True))


class ServerOptimizerOptions(FederatedOptions):
    """The server optimizer of the adaptive federated optimization framework (Reddi et al. 2021).

    The pseudo-gradient Δ = θ̄_agg − θ̄ (the aggregate minus the current global model) is fed to
    ``optimizer``: ``sgd`` θ̄ += η Δ (η = 1 is plain averaging); ``avgm`` (FedAvgM) m = β m + Δ,
    θ̄ += η m, with β = ``momentum``; ``adagrad``, ``adam``, ``yogi`` m = β1 m + (1−β1) Δ, v per
    the paper (v += Δ²; v = β2 v + (1−β2) Δ²; v −= (1−β2) Δ² sign(v − Δ²)), θ̄ += η m / (√v + τ),
    with m₋₁ = 0 and v₋₁ = ``initial_v`` (default τ², Algorithm 2; Flower starts at 0).
    ``bias_correction`` scales η by √(1−β2ᵗ)/(1−β1ᵗ) at round t (Flower's FedAdam does, with t + 1;
    not in the paper).
    """

    optimizer: str = "sgd"
    lr: float = Field(1.0, gt=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.99, ge=0.0, lt=1.0)
    tau: float = Field(1e-3, gt=0.0)
    initial_v: float | None = Field(None, ge=0.0)
    bias_correction: bool = False

    @field_validator("optimizer")
    @classmethod
    def _declared(cls, optimizer: str) -> str:
        return _registered(SERVER_OPTIMIZERS, optimizer)

    @model_validator(mode="after")
    def _bias_correction_needs_moments(self) -> ServerOptimizerOptions:
        if self.bias_correction and not self.declaration.corrects_bias:
            corrected = " and ".join(name for name, member in SERVER_OPTIMIZERS.items() if member.corrects_bias)
            raise ValueError(f"bias_correction: corrects the moments of {corrected}, not {self.optimizer}'s")
        return self

    @property
    def declaration(self) -> ServerOptimizer:
        """The declaration of ``optimizer``."""
        return SERVER_OPTIMIZERS[self.optimizer]

    @property
    def is_identity(self) -> bool:
        """Plain averaging: θ̄ = the aggregate, no server optimizer state."""
        return self.declaration.plain_at_unit_lr and self.lr == 1.0


@dataclass(frozen=True)
class Aggregator(FederatedMember):
    """An aggregation rule: ``implementation`` names ``fn(stack, weights, options) -> (aggregate, kept)`` over the
    ``(n, P)`` stack of the n messages (:mod:`mergeflow.federated.robust`). ``identity``: it is the
    algorithm's own average, so no rule replaces the algorithm's server step; ``least_messages`` (a, b): it
    needs n ≥ a·f + b messages; ``chooses_m``: it keeps the ``m`` best messages, at most n − f.
    """

    identity: bool = False
    least_messages: tuple[int, int] = (0, 0)
    chooses_m: bool = False


AGGREGATORS: Registry[Aggregator] = Registry("aggregator")
_ROBUST = "mergeflow.federated.robust"
AGGREGATORS.declare(Aggregator("mean", f"{_ROBUST}:weighted_average", identity=True))
AGGREGATORS.declare(Aggregator("median", f"{_ROBUST}:coordinate_median"))
AGGREGATORS.declare(Aggregator("trimmed_mean", f"{_ROBUST}:trimmed_mean"))
AGGREGATORS.declare(Aggregator("krum", f"{_ROBUST}:krum", least_messages=(2, 3)))
AGGREGATORS.declare(Aggregator("multikrum", f"{_ROBUST}:multikrum", least_messages=(2, 3), chooses_m=True))
AGGREGATORS.declare(Aggregator("bulyan", f"{_ROBUST}:bulyan", least_messages=(4, 3)))


class AggregatorOptions(FederatedOptions):
    """How the server combines the clients' models when the algorithm's server step is an average.

    ``name``: ``mean`` (the algorithm's own weighted average), ``median`` (coordinate-wise; the mean
    of the two middle values for an even count), ``trimmed_mean`` (per coordinate, drop the ⌊β n⌋
    largest and smallest, average the rest), ``krum`` (the one message with the least sum of squared
    distances to its n − f − 2 nearest others), ``multikrum`` (the average of the ``m`` messages with
    the best Krum scores; m = n − f by default), ``bulyan`` (n − 2f messages chosen by repeated Krum,
    then per coordinate the average of the n − 4f of them closest to their median). ``f``: the number
    of Byzantine clients the rule must survive. The robust rules weight every kept message equally.
    """

    name: str = "mean"
    beta: float = Field(0.1, ge=0.0, lt=0.5)
    f: int = Field(1, ge=0)
    m: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @field_validator("name")
    @classmethod
    def _declared(cls, name: str) -> str:
        return _registered(AGGREGATORS, name)

    @property
    def declaration(self) -> Aggregator:
        """The declaration of rule ``name``."""
        return AGGREGATORS[self.name]

    def check_participants(self, n: int) -> str | None:
        """Why this rule cannot run on ``n`` messages (one line naming the key), or None."""
        declaration = self.declaration
        a, b = declaration.least_messages
        if n < a * self.f + b:
            return f"federated.aggregator.f: {self.name} needs n ≥ {a}f + {b} messages per round; n = {n}, f = {self.f}"
        if declaration.chooses_m and self.m is not None and self.m > n - self.f:
            return f"federated.aggregator.m: {self.name} keeps at most n − f = {n - self.f} messages, not {self.m}"
        return None

    @property
    def is_identity(self) -> bool:
        """The algorithm's own average: no robust rule."""
        return self.declaration.identity


@dataclass(frozen=True)
class Attack(FederatedMember):
    """A Byzantine attack. ``poisons_data``: a data attack, whose ``implementation`` is
    ``fn(data, num_classes) -> data``, the attacker's poisoned training data (its message is then honest
    training on them); otherwise a model attack, ``fn(anchor, theta, options, generator) -> tensor``: what the
    attacker sends for one parameter instead of its θ_k, from the global θ̄ it started at.
    """

    poisons_data: bool = False


ATTACKS: Registry[Attack] = Registry("attack")
_ATTACKS = "mergeflow.federated.attacks"
ATTACKS.declare(Attack("sign_flip", f"{_ATTACKS}:sign_flip"))
ATTACKS.declare(Attack("gaussian", f"{_ATTACKS}:gaussian"))
ATTACKS.declare(Attack("scaled", f"{_ATTACKS}:scaled"))
ATTACKS.declare(Attack("label_flip", f"{_ATTACKS}:flip_labels", poisons_data=True))


class AttackOptions(FederatedOptions):
    """Byzantine clients, to test aggregators: ``clients`` of them, drawn once from the seed.

    ``kind`` (Δ_k = θ_k − θ̄ is the honest update): ``sign_flip`` sends θ̄ − scale·Δ_k; ``gaussian``
    sends θ̄ + ε, ε ~ N(0, scale²) per coordinate; ``scaled`` (model replacement) sends θ̄ + scale·Δ_k;
    ``label_flip`` trains on labels y → C − 1 − y (a data attack: the message is honest training on
    poisoned data; ``scale`` unused).
    """

    clients: int = Field(1, ge=0)
    kind: str = "sign_flip"
    scale: float = Field(1.0, ge=0.0)

    @field_validator("kind")
    @classmethod
    def _declared(cls, kind: str) -> str:
        return _registered(ATTACKS, kind)

    @property
    def declaration(self) -> Attack:
        """The declaration of attack ``kind``."""
        return ATTACKS[self.kind]

    @property
    def poisons_data(self) -> bool:
        """A data attack (the attacker trains on poisoned labels), not a rewritten message."""
        return self.declaration.poisons_data


def server_step_members(
    server: ServerOptimizerOptions, aggregator: AggregatorOptions, attack: AttackOptions | None
) -> tuple[Member, ...]:
    """The members a server step runs besides its algorithm: its server optimizer and aggregator unless they
    are plain averaging, and a model attack that has attackers (a data attack acts on the attackers' training)."""
    used: list[Member] = []
    if not server.is_identity:
        used.append(server.declaration)
    if not aggregator.is_identity:
        used.append(aggregator.declaration)
    if attack is not None and attack.clients > 0 and not attack.poisons_data:
        used.append(attack.declaration)
    return tuple(used)


AXES: tuple[Registry[Any], ...] = (ALGORITHMS, AGGREGATORS, SERVER_OPTIMIZERS, ATTACKS)


def member_modules() -> tuple[str, ...]:
    """The module of every declared member of the federated axes (:data:`AXES`), each once."""
    return tuple(dict.fromkeys(member.module for axis in AXES for member in axis.values() if member.module))


class DPOptions(FederatedOptions):
    """Client-level differential privacy, DP-FedAvg (McMahan et al. 2018).

    Each round every client is sampled independently with probability q = ``federated.fraction``
    (Poisson sampling, as the paper and the accountant assume); each update Δ_k = θ_k − θ̄ is clipped
    to norm ``clip``; the server adds N(0, σ²·clip²) to their sum and divides by qK. σ is
    ``noise_multiplier``, or the least σ whose total ε over the run's rounds is ``target_epsilon``
    (Opacus' RDP accountant). ``adaptive`` clipping (Andrew et al. 2021) moves the clip towards the
    ``target_quantile`` γ of the update norms, C ← C·exp(−``clip_lr``·(b̃ − γ)), b̃ the fraction of
    unclipped updates with N(0, ``count_noise``²) on its count (default qK/20); σ is then the
    mechanism's total noise and the sum gets σ_Δ = (σ⁻² − (2·count_noise)⁻²)^(−1/2).
    """

    clip: float = Field(1.0, gt=0.0)
    noise_multiplier: float | None = Field(None, ge=0.0)
    target_epsilon: float | None = Field(None, gt=0.0)
    delta: float = Field(1e-5, gt=0.0, lt=1.0)
    adaptive: bool = False
    target_quantile: float = Field(0.5, ge=0.0, le=1.0)
    clip_lr: float = Field(0.2, gt=0.0)
    count_noise: float | None = Field(None, gt=0.0)

    @model_validator(mode="after")
    def _one_noise(self) -> DPOptions:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("set exactly one of noise_multiplier and target_epsilon")
        return self

    def count_noise_for(self, expected_clients: float) -> float:
        """σ_b of the clipped-count query: ``count_noise``, or qK/20 (Andrew et al.)."""
        return self.count_noise if self.count_noise is not None else expected_clients / 20.0
