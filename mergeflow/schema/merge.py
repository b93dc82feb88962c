"""What params can say about each merge method: its options model and the inputs it needs.

Torch-free on purpose: validating params (``mergeflow validate``, and every run before its heavy
work) imports this module, not the methods' code. A built-in method is declared here and
implemented in its own module with ``@merge_method`` (``mergeflow.merge.registry``), which takes
the declaration; a method registered from a notebook declares itself through ``merge_method``'s
``options``, ``needs`` and ``uses``.

Inputs a method can need besides the weights: ``"base"`` (the shared base model), ``"sizes"``
(client data sizes), ``"fishers"`` (diagonal Fishers, one dict per client), ``"factors"``
(per-client Fisher factors U with F ≈ UᵀU over the flattened parameters), ``"grams"`` (per-client
Gram matrices XᵀX of each linear layer's inputs, keyed by its weight) and ``"scorer"`` (a function
scoring a whole state dict on held-out data, higher is better).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from mergeflow.errors import ConfigError, did_you_mean

NEEDS = ("base", "sizes", "fishers", "factors", "grams", "scorer")
PriorMean = Literal["auto", "base", "zero"]


class NoOptions(BaseModel):
    """Options of a method that takes none."""

    model_config = ConfigDict(extra="forbid")


class TaskArithmeticOptions(BaseModel):
    """λ scales the summed task vectors; 1/K makes it the plain average."""

    model_config = ConfigDict(extra="forbid")
    scaling: float = 0.3


class FisherOptions(BaseModel):
    """How the clients' diagonal Fishers F_k weight their parameters.

    ``by_size`` multiplies F_k (an average over examples) by n_k/N, so the weights are the
    clients' data precisions, as in a product of Gaussian posteriors. ``coefficients`` are
    explicit λ_k; ``normalize`` divides λ_k by the global L2 norm of F_k; ``floor`` keeps a
    parameter that no client has information about from dividing by zero.
    """

    model_config = ConfigDict(extra="forbid")
    coefficients: list[float] | None = None
    by_size: bool = True
    normalize: bool = False
    floor: float = Field(1e-8, ge=0)


class TiesOptions(BaseModel):
    """``density``: the fraction of each task vector kept (top magnitudes, per tensor as in PEFT and
    mergekit; the paper's k = 20%); ``scaling``: λ on the merged task vector."""

    model_config = ConfigDict(extra="forbid")
    density: float = Field(0.2, gt=0, le=1)
    scaling: float = 1.0


class DareOptions(BaseModel):
    """``drop_rate``: p, each entry's drop probability (survivors scaled by 1/(1−p)); ``scaling``: λ;
    ``seed``: the draws, derived per tensor from it and the tensor's name."""

    model_config = ConfigDict(extra="forbid")
    drop_rate: float = Field(0.9, ge=0, lt=1)
    scaling: float = 1.0
    seed: int = 0


class BreadcrumbsOptions(BaseModel):
    """Model Breadcrumbs (Davari & Belilovsky 2024), as mergekit's ``breadcrumbs`` / ``breadcrumbs_ties``.

    Per tensor, each task vector drops its ``gamma`` fraction of largest magnitudes (outliers) and
    keeps the next ``density`` fraction; the smallest rest is dropped. ``scaling``: λ on the merged
    task vector. ``normalize`` (mergekit's, off by default as there): divide the sum by K
    (``breadcrumbs``) or by each entry's count of sign-agreeing clients (``breadcrumbs_ties``,
    TIES' disjoint mean).
    """

    model_config = ConfigDict(extra="forbid")
    density: float = Field(0.2, gt=0, le=1)
    gamma: float = Field(0.01, ge=0, lt=1)
    scaling: float = 1.0
    normalize: bool = False

    @field_validator("gamma")
    @classmethod
    def _kept_and_dropped_fit(cls, gamma: float, info: ValidationInfo) -> float:
        density = info.data.get("density")
        if density is not None and density + gamma > 1:
            raise ValueError(f"density + gamma = {density + gamma:g} exceeds 1 (the kept and the dropped outliers)")
        return gamma


class DellaOptions(BaseModel):
    """DELLA (Deep et al. 2024), as mergekit's ``della`` / ``della_linear``.

    Per row of each task vector (a 1-D tensor is one row; a conv kernel's rows are its output
    channels), entries ranked by magnitude get keep probabilities spread evenly over
    [``density`` − ``epsilon``, ``density`` + ``epsilon``], the largest the highest; the kept ones are
    rescaled (``rescale``: by 1/p as in the paper, ``l1`` to the task vector's L1 norm as mergekit
    0.1.5 does, or ``none``). ``scaling``: λ; ``seed``: the draws, derived per tensor from it and the
    tensor's name.
    """

    model_config = ConfigDict(extra="forbid")
    density: float = Field(0.5, gt=0, le=1)
    epsilon: float = Field(0.1, ge=0)
    scaling: float = 1.0
    rescale: Literal["probability", "l1", "none"] = "probability"
    seed: int = 0

    @field_validator("epsilon")
    @classmethod
    def _probabilities_in_range(cls, epsilon: float, info: ValidationInfo) -> float:
        density = info.data.get("density")
        if density is not None and not epsilon < density:
            raise ValueError(f"must be below density ({density:g}): keep probabilities start at density − epsilon > 0")
        if density is not None and density + epsilon > 1:
            raise ValueError(f"density + epsilon = {density + epsilon:g} exceeds 1: a keep probability above 1")
        return epsilon


class SlerpOptions(BaseModel):
    """``t``: 0 gives the first model, 1 the second."""

    model_config = ConfigDict(extra="forbid")
    t: float = Field(0.5, ge=0, le=1)


class RegMeanOptions(BaseModel):
    """``alpha`` scales the Grams' off-diagonal entries (the paper's regularisation; 1 = exact Grams)."""

    model_config = ConfigDict(extra="forbid")
    alpha: float = Field(0.9, gt=0, le=1)


class ExactOptions(BaseModel):
    """Prior precision δ and mean (``auto``: the base model when one is given, else zero), whether
    precisions scale with data size, and the CG budget."""

    model_config = ConfigDict(extra="forbid")
    prior_precision: float = Field(1e-3, ge=0)
    prior_mean: PriorMean = "auto"
    by_size: bool = True
    max_iterations: int = Field(1000, ge=1)
    tolerance: float = Field(1e-12, gt=0)
    preconditioner: Literal["woodbury", "jacobi", "none"] = "woodbury"


class SSFOptions(BaseModel):
    """Masking, optimisation and the start point of the SSF merge.

    The paper optimises with SGD from a random init; Adam from the average is the default
    here because its step size does not depend on the scale of the precisions. The cosine
    schedule anneals the noise of the random masks away, so θ settles instead of hovering.
    """

    model_config = ConfigDict(extra="forbid")
    mask_rate: float = Field(0.3, gt=0, le=1)
    masks_per_step: int = Field(10, ge=1)
    steps: int = Field(300, ge=1)
    window: int | None = Field(1000, ge=2)
    lr: float = Field(0.003, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    optimizer: Literal["sgd", "adam"] = "adam"
    schedule: Literal["constant", "cosine"] = "cosine"
    start: Literal["random", "average"] = "average"
    prior_precision: float = Field(1e-3, ge=0)
    prior_mean: PriorMean = "auto"
    by_size: bool = True
    seed: int = 0


# --- Spectral and geometric merges (Karcher, TSV-M, Iso-C, Iso-CTS) ---


class KarcherOptions(BaseModel):
    """The Karcher-mean iteration on each tensor's sphere, as mergekit's ``karcher``: at most ``max_iter``
    Riemannian gradient steps, stopping when the step's length falls below ``tol`` (also the norm below
    which an input counts as zero). ``by_size`` weights the clients by n_k/N (mergekit: uniform)."""

    model_config = ConfigDict(extra="forbid")
    max_iter: int = Field(10, ge=1)
    tol: float = Field(1e-5, gt=0, lt=1)
    by_size: bool = False


class TsvOptions(BaseModel):
    """TSV-M (Gargiulo et al. 2025): ``scaling`` is α on the merged task vector (FusionBench's ``alpha``);
    ``rank_fraction`` the fraction of each task matrix's singular vectors kept (None: 1/K, the paper's)."""

    model_config = ConfigDict(extra="forbid")
    scaling: float = Field(1.0, gt=0)
    rank_fraction: float | None = Field(None, gt=0, le=1)


class IsoCOptions(BaseModel):
    """Iso-C (Marczak et al. 2025): ``scaling`` is α on the merged task vector (FusionBench's
    ``scaling_factor``)."""

    model_config = ConfigDict(extra="forbid")
    scaling: float = Field(1.0, gt=0)


class IsoCtsOptions(BaseModel):
    """Iso-CTS (Marczak et al. 2025): ``scaling`` is α; ``common_space_fraction`` the share of each matrix's
    rank given to the summed task matrix's top singular vectors, the rest split among the tasks."""

    model_config = ConfigDict(extra="forbid")
    scaling: float = Field(1.0, gt=0)
    common_space_fraction: float = Field(0.8, ge=0, le=1)


# --- end of the spectral and geometric merges' options ---


@dataclass(frozen=True)
class MethodDeclaration:
    """A method's options model, the inputs it needs and those it uses when given (``uses`` ⊇ ``needs``),
    and how many models it merges: ``models = (least, most)``, ``most`` None for no limit."""

    options: type[BaseModel]
    needs: frozenset[str]
    uses: frozenset[str]
    models: tuple[int, int | None] = (1, None)

    def model_count_problem(self, count: int) -> str | None:
        """Why ``count`` models do not suit this method (``"merges exactly 2 models"``), or None when they do."""
        least, most = self.models
        if least <= count and (most is None or count <= most):
            return None
        if least == most:
            return f"merges exactly {least} models"
        return f"merges at least {least} models" if most is None else f"merges {least} to {most} models"


DECLARED: dict[str, MethodDeclaration] = {}


def declare(
    name: str,
    options: type[BaseModel] = NoOptions,
    needs: Sequence[str] = (),
    uses: Sequence[str] = (),
    models: tuple[int, int | None] = (1, None),
) -> MethodDeclaration:
    """Declare method ``name``: its options model, required inputs, optional ones and how many models it merges."""
    unknown = (set(needs) | set(uses)) - set(NEEDS)
    if unknown:
        raise ValueError(f"merge method {name!r} needs unknown inputs {sorted(unknown)}; known: {NEEDS}")
    if name in DECLARED:
        raise ValueError(f"merge method {name!r} is declared twice")
    DECLARED[name] = MethodDeclaration(options, frozenset(needs), frozenset(needs) | frozenset(uses), models)
    return DECLARED[name]


declare("average")
declare("weighted", needs=("sizes",))
declare("task_arithmetic", TaskArithmeticOptions, needs=("base",))
declare("fisher", FisherOptions, needs=("fishers",))
declare("ties", TiesOptions, needs=("base",))
declare("dare_linear", DareOptions, needs=("base",))
declare("dare_ties", DareOptions, needs=("base",))
declare("breadcrumbs", BreadcrumbsOptions, needs=("base",))
declare("breadcrumbs_ties", BreadcrumbsOptions, needs=("base",))
declare("della", DellaOptions, needs=("base",))
declare("della_linear", DellaOptions, needs=("base",))
declare("model_stock", needs=("base",))
declare("slerp", SlerpOptions, models=(2, 2))
declare("regmean", RegMeanOptions, needs=("grams",))
declare("greedy_soup", needs=("scorer",))
declare("exact", ExactOptions, needs=("fishers",), uses=("factors", "base"))
declare("ssf", SSFOptions, needs=("fishers",), uses=("factors", "base"))
# Spectral and geometric merges (mergeflow.merge.karcher, .tsv, .isotropic)
declare("karcher", KarcherOptions)
declare("tsv", TsvOptions, needs=("base",))
declare("iso_c", IsoCOptions, needs=("base",))
declare("iso_cts", IsoCtsOptions, needs=("base",), models=(2, None))


def validate_options(method: str, options: Mapping[str, object]) -> BaseModel:
    """Parse a method's options, raising ConfigError that names the method and key."""
    if method not in DECLARED:
        hint = did_you_mean(method, DECLARED)
        raise ConfigError([f"merge method {method!r} is unknown{hint}; known: {', '.join(DECLARED)}"])
    try:
        return DECLARED[method].options.model_validate(dict(options))
    except ValidationError as error:
        raise ConfigError.from_validation(f"merge.options.{method}", error) from None
