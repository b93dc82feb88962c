"""What params can say about each federated algorithm: its options model.

Torch-free on purpose: validating params imports this module, not the algorithms' code. A
built-in algorithm's options model is declared here and its class (``Options``) refers to it; an
algorithm registered from a notebook declares its own through ``register_algorithm``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mergeflow.errors import ConfigError, did_you_mean


class StrictOptions(BaseModel):
    """Base of the options models: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class FedAvgOptions(StrictOptions):
    """``weighting``: ``"size"`` averages with n_k/N over the participants, ``"uniform"`` with 1/|P|."""

    weighting: Literal["size", "uniform"] = "size"


class FedProxOptions(FedAvgOptions):
    """``mu``: weight of the proximal term μ/2·‖θ − θ̄‖² added to the local mean loss."""

    mu: float = Field(0.01, ge=0.0)


class FedADMMOptions(StrictOptions):
    """``rho``: penalty and dual step ρ; ``prior_precision``: the server's L2 prior precision δ (0: none)."""

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
