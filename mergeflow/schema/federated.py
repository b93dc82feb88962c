"""What params can say about each federated algorithm: its options model.

Torch-free on purpose: validating params imports this module, not the algorithms' code. A
built-in algorithm's options model is declared here and its class (``Options``) refers to it; an
algorithm registered from a notebook declares its own through ``register_algorithm``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mergeflow.errors import ConfigError, did_you_mean


class StrictOptions(BaseModel):
    """Base of the options models: unknown keys are errors, assignments are validated.

    Two declarations say which server-side options an algorithm's maths allows:
    ``averages_messages``: its server step is an average of the clients' ``mean.`` messages (a robust
    aggregator or DP-FedAvg's clipped, noised average may replace it); ``point_estimate``: its global
    model is a point θ̄ (a server optimizer may step on θ̄'s change). Both False unless declared.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    averages_messages: ClassVar[bool] = False
    point_estimate: ClassVar[bool] = False


class FedAvgOptions(StrictOptions):
    """``weighting``: ``"size"`` averages with n_k/N over the participants, ``"uniform"`` with 1/|P|."""

    averages_messages: ClassVar[bool] = True
    point_estimate: ClassVar[bool] = True
    weighting: Literal["size", "uniform"] = "size"


class FedProxOptions(FedAvgOptions):
    """``mu``: weight of the proximal term μ/2·‖θ − θ̄‖² added to the local mean loss."""

    mu: float = Field(0.01, ge=0.0)


class FedADMMOptions(StrictOptions):
    """``rho``: penalty and dual step ρ; ``prior_precision``: the server's L2 prior precision δ (0: none)."""

    point_estimate: ClassVar[bool] = True
    rho: float = Field(1.0, gt=0.0)
    prior_precision: float = Field(0.0, ge=0.0)


class RunawayGuardOptions(StrictOptions):
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


DECLARED: dict[str, type[BaseModel]] = {
    "fedavg": FedAvgOptions,
    "fedprox": FedProxOptions,
    "fedadmm": FedADMMOptions,
    "bayes_admm": BayesADMMOptions,
}


def validate_options(name: str, options: BaseModel | Mapping[str, Any] | None = None) -> BaseModel:
    """Validate algorithm ``name``'s options (a mapping, an options model or None for the defaults).

    Raises:
        ConfigError: on an unknown algorithm, or naming the algorithm and the offending key.
    """
    if name not in DECLARED:
        hint = did_you_mean(name, DECLARED)
        raise ConfigError([f"federated algorithm {name!r} is unknown{hint}; known: {', '.join(DECLARED)}"])
    model = DECLARED[name]
    if isinstance(options, model):
        return options
    if isinstance(options, BaseModel):
        options = options.model_dump()
    try:
        return model.model_validate(dict(options or {}))
    except ValidationError as error:
        raise ConfigError.from_validation(f"federated.options.{name}", error) from None


# ----------------------------------------------------------------------------- server-side options


def participants_per_round(num_clients: int, fraction: float) -> int:
    """How many clients a round samples: ``max(1, round(fraction · K))``, at most K."""
    return min(num_clients, max(1, math.floor(fraction * num_clients + 0.5)))


class ServerOptimizerOptions(StrictOptions):
    """The server optimizer of the adaptive federated optimization framework (Reddi et al. 2021).

    The pseudo-gradient Δ = θ̄_agg − θ̄ (the aggregate minus the current global model) is fed to
    ``optimizer``: ``sgd`` θ̄ += η Δ (η = 1 is plain averaging); ``avgm`` (FedAvgM) m = β m + Δ,
    θ̄ += η m, with β = ``momentum``; ``adagrad``, ``adam``, ``yogi`` m = β1 m + (1−β1) Δ, v per
    the paper (v += Δ²; v = β2 v + (1−β2) Δ²; v −= (1−β2) Δ² sign(v − Δ²)), θ̄ += η m / (√v + τ),
    with m₋₁ = 0 and v₋₁ = ``initial_v`` (default τ², Algorithm 2; Flower starts at 0).
    ``bias_correction`` scales η by √(1−β2ᵗ)/(1−β1ᵗ) at round t (Flower's FedAdam does, with t + 1;
    not in the paper).
    """

    optimizer: Literal["sgd", "avgm", "adagrad", "adam", "yogi"] = "sgd"
    lr: float = Field(1.0, gt=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.99, ge=0.0, lt=1.0)
    tau: float = Field(1e-3, gt=0.0)
    initial_v: float | None = Field(None, ge=0.0)
    bias_correction: bool = False

    @model_validator(mode="after")
    def _bias_correction_needs_moments(self) -> ServerOptimizerOptions:
        if self.bias_correction and self.optimizer not in ("adam", "yogi"):
            raise ValueError(f"bias_correction: corrects Adam's and Yogi's moments, not {self.optimizer}'s")
        return self

    @property
    def is_identity(self) -> bool:
        """Plain averaging: θ̄ = the aggregate, no server optimizer state."""
        return self.optimizer == "sgd" and self.lr == 1.0


class AggregatorOptions(StrictOptions):
    """How the server combines the clients' models when the algorithm's server step is an average.

    ``name``: ``mean`` (the algorithm's own weighted average), ``median`` (coordinate-wise; the mean
    of the two middle values for an even count), ``trimmed_mean`` (per coordinate, drop the ⌊β n⌋
    largest and smallest, average the rest), ``krum`` (the one message with the least sum of squared
    distances to its n − f − 2 nearest others), ``multikrum`` (the average of the ``m`` messages with
    the best Krum scores; m = n − f by default), ``bulyan`` (n − 2f messages chosen by repeated Krum,
    then per coordinate the average of the n − 4f of them closest to their median). ``f``: the number
    of Byzantine clients the rule must survive. The robust rules weight every kept message equally.
    """

    name: Literal["mean", "median", "trimmed_mean", "krum", "multikrum", "bulyan"] = "mean"
    beta: float = Field(0.1, ge=0.0, lt=0.5)
    f: int = Field(1, ge=0)
    m: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    def check_participants(self, n: int) -> str | None:
        """Why this rule cannot run on ``n`` messages (one line naming the key), or None."""
        if self.name in ("krum", "multikrum") and n <= 2 * self.f + 2:
            return f"federated.aggregator.f: {self.name} needs n > 2f + 2 messages per round; n = {n}, f = {self.f}"
        if self.name == "multikrum" and self.m is not None and self.m > n - self.f:
            return f"federated.aggregator.m: multikrum keeps at most n − f = {n - self.f} messages, not {self.m}"
        if self.name == "bulyan" and n < 4 * self.f + 3:
            return f"federated.aggregator.f: bulyan needs n ≥ 4f + 3 messages per round; n = {n}, f = {self.f}"
        return None

    @property
    def is_identity(self) -> bool:
        """The algorithm's own average: no robust rule."""
        return self.name == "mean"


class AttackOptions(StrictOptions):
    """Byzantine clients, to test aggregators: ``clients`` of them, drawn once from the seed.

    ``kind`` (Δ_k = θ_k − θ̄ is the honest update): ``sign_flip`` sends θ̄ − scale·Δ_k; ``gaussian``
    sends θ̄ + ε, ε ~ N(0, scale²) per coordinate; ``scaled`` (model replacement) sends θ̄ + scale·Δ_k;
    ``label_flip`` trains on labels y → C − 1 − y (a data attack: the message is honest training on
    poisoned data; ``scale`` unused).
    """

    clients: int = Field(1, ge=0)
    kind: Literal["sign_flip", "gaussian", "scaled", "label_flip"] = "sign_flip"
    scale: float = Field(1.0, ge=0.0)

    @property
    def poisons_data(self) -> bool:
        """A data attack (the attacker trains on poisoned labels), not a rewritten message."""
        return self.kind == "label_flip"


class DPOptions(StrictOptions):
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
