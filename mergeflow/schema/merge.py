"""The merge methods' declarations: what params can say about each method and what the engine needs to run it.

Torch-free on purpose: validating params (``mergeflow validate``, and every run before its heavy
work) imports this module, not the methods' code. A method is one :class:`MergeMethod` declared in
:data:`DECLARED` (its options model, the inputs it needs, how the engine may merge it, and its
``implementation``, a ``"module:attr"`` reference to its function), plus that module: the engine
(``mergeflow.merge.engine``) imports the module of the method it runs and no other, and a merge step is
keyed by that module's import closure. A method from a notebook declares itself through
``mergeflow.merge.merge_method``.

Inputs a method can need besides the weights: ``"base"`` (the shared base model), ``"sizes"``
(client data sizes), ``"fishers"`` (diagonal Fishers, one dict per client), ``"factors"``
(per-client Fisher factors U with F ≈ UᵀU over the flattened parameters), ``"grams"`` (per-client
Gram matrices XᵀX of each linear layer's inputs, keyed by its weight) and ``"scorer"`` (a function
scoring a whole state dict on held-out data, higher is better).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from mergeflow.errors import ConfigError
from mergeflow.registry import Member, NoOptions, Registry

NEEDS = ("base", "sizes", "fishers", "factors", "grams", "scorer")
# The method that merges a floating tensor the given Fishers do not cover (``mergeflow.merge.engine.tensor_method``).
UNCOVERED = "average"
PriorMean = Literal["auto", "base", "zero"]


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
    ``prior_correction`` says where the (K−1)/K prior correction goes (mergeflow/merge/ssf.py):
    ``per_client`` keeps the loss bounded below; ``as_printed`` is Eq. 7 as the paper prints it.
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
    prior_correction: Literal["per_client", "as_printed"] = "per_client"
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
class MergeMethod(Member):
    """A merge method: its ``name``, its ``implementation`` (``"module:attr"`` of its function), its ``Options``
    model, the inputs it needs and those it uses when given (``uses`` ⊇ ``needs``), how many models it merges
    (``models = (least, most)``, ``most`` None for no limit), and how the engine may merge it:

    - ``scope``: ``"tensor"``, a function ``fn(x: TensorInputs, options) -> tensor`` over the K clients'
      copies of one tensor (merged the same in memory or streamed from files); ``"model"``, a function
      ``fn(x: ModelInputs, options) -> MergeResult | dict`` over whole models, for a method that couples
      all parameters (the exact Gaussian merge's one CG solve).
    - ``elementwise``: output element i depends only on element i of each input, so a streamed merge takes
      blocks of elements (tensor scope only).
    - ``masks``: ``"module:attr"`` of a function drawing per-client masks from each whole task vector (TIES'
      top magnitudes, DARE's draws), ``masks(tasks, shape, name, options) -> the K masks in order``; given
      them (``TensorInputs.masks``), ``fn`` is elementwise, so a streamed merge holds one task vector and K
      boolean masks of a tensor, never its K float64 copies.
    - ``gram``: ``fn`` reads the whole tensor only through the K × K Gram matrix of its inputs (``"inputs"``)
      or task vectors θ_k − base (``"tasks"``), ``TensorInputs.gram``, and is otherwise elementwise (Model
      Stock's angle, SLERP's): a streamed merge sums the Gram over blocks in a first pass, then merges
      blocks in a second.
    - ``stored``: ``fn`` takes its tensors as stored (float32 or float64, one dtype for the clients) and
      widens them itself, never writing them, so a streamed merge on the CPU may pass views of the files'
      read-only memory maps instead of float64 copies (``sparsify.masked_merge`` does, and DELLA's compiled
      kernel); blocks of them for an elementwise method, else whole tensors.
    """

    name: str
    implementation: str
    Options: type[BaseModel] = NoOptions
    needs: AbstractSet[str] = frozenset()
    uses: AbstractSet[str] = frozenset()
    models: tuple[int, int | None] = (1, None)
    scope: Literal["tensor", "model"] = "tensor"
    elementwise: bool = False
    masks: str | None = None
    gram: Literal["inputs", "tasks"] | None = None
    stored: bool = False
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "needs", frozenset(self.needs))
        object.__setattr__(self, "uses", frozenset(self.needs) | frozenset(self.uses))
        object.__setattr__(self, "elementwise", self.elementwise or self.masks is not None or self.gram is not None)
        problem = self._inconsistency()
        if problem:
            raise ValueError(f"merge method {self.name!r}: {problem}")

    def _inconsistency(self) -> str | None:
        unknown = self.uses - set(NEEDS)
        if unknown:
            return f"needs unknown inputs {sorted(unknown)}; known: {NEEDS}"
        if self.scope != "tensor" and (self.elementwise or self.stored):
            return "only a tensor-scope method can be elementwise or take its tensors as stored"
        if (self.masks is not None or self.gram == "tasks") and "base" not in self.needs:
            return "its masks or Gram are of task vectors, so it needs base"
        return None

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules a merge with it runs (a merge step's :attr:`tasks.steps.Step.members`): its implementation's,
        its masks', and for a tensor-scope method that uses Fishers, :data:`UNCOVERED`'s."""
        references = [self.implementation, self.masks or ""]
        if self.scope == "tensor" and "fishers" in self.uses and self.name != UNCOVERED:
            references.append(DECLARED[UNCOVERED].implementation)
        return tuple(dict.fromkeys(ref.partition(":")[0] for ref in references if ref))

    def parse(self, options: Mapping[str, object] | BaseModel | None = None) -> BaseModel:
        """The validated options model from ``merge.options.<name>`` (a mapping, a model or None).

        Raises:
            ConfigError: naming ``merge.options.<name>.<key>`` for an invalid key.
        """
        if isinstance(options, self.Options):
            return options
        try:
            return self.Options.model_validate(dict(options or {}))
        except ValidationError as error:
            raise ConfigError.from_validation(f"merge.options.{self.name}", error) from None

    def model_count_problem(self, count: int) -> str | None:
        """Why ``count`` models do not suit this method (``"merges exactly 2 models"``), or None when they do."""
        least, most = self.models
        if least <= count and (most is None or count <= most):
            return None
        if least == most:
            return f"merges exactly {least} models"
        return f"merges at least {least} models" if most is None else f"merges {least} to {most} models"


def _sparsifying(name: str, module: str, options: type[BaseModel]) -> MergeMethod:
    """A method of ``module`` (function ``name``) that merges the task vectors under the per-client masks that
    the module's ``masks`` draws (``mergeflow.merge.sparsify``), taking its tensors as stored."""
    return MergeMethod(name, f"{module}:{name}", options, {"base"}, masks=f"{module}:masks", stored=True)


DECLARED: Registry[MergeMethod] = Registry("merge method")
declare = DECLARED.declare

declare(MergeMethod("average", "mergeflow.merge.average:average", elementwise=True))
declare(MergeMethod("weighted", "mergeflow.merge.weighted:weighted", needs={"sizes"}, elementwise=True))
declare(
    MergeMethod(
        "task_arithmetic",
        "mergeflow.merge.task_arithmetic:task_arithmetic",
        TaskArithmeticOptions,
        {"base"},
        elementwise=True,
    )
)
declare(MergeMethod("fisher", "mergeflow.merge.fisher:fisher", FisherOptions, {"fishers"}, elementwise=True))
declare(_sparsifying("ties", "mergeflow.merge.ties", TiesOptions))
declare(_sparsifying("dare_linear", "mergeflow.merge.dare", DareOptions))
declare(_sparsifying("dare_ties", "mergeflow.merge.dare", DareOptions))
declare(_sparsifying("breadcrumbs", "mergeflow.merge.breadcrumbs", BreadcrumbsOptions))
declare(_sparsifying("breadcrumbs_ties", "mergeflow.merge.breadcrumbs", BreadcrumbsOptions))
declare(MergeMethod("della", "mergeflow.merge.della:della", DellaOptions, {"base"}, stored=True))
declare(MergeMethod("della_linear", "mergeflow.merge.della:della_linear", DellaOptions, {"base"}, stored=True))
declare(MergeMethod("model_stock", "mergeflow.merge.model_stock:model_stock", needs={"base"}, gram="tasks"))
declare(MergeMethod("slerp", "mergeflow.merge.slerp:slerp", SlerpOptions, models=(2, 2), gram="inputs"))
declare(MergeMethod("regmean", "mergeflow.merge.regmean:regmean", RegMeanOptions, {"grams"}, scope="model"))
declare(MergeMethod("greedy_soup", "mergeflow.merge.soup:greedy_soup", needs={"scorer"}, scope="model"))
declare(
    MergeMethod("exact", "mergeflow.merge.exact:exact", ExactOptions, {"fishers"}, {"factors", "base"}, scope="model")
)
declare(MergeMethod("ssf", "mergeflow.merge.ssf:ssf", SSFOptions, {"fishers"}, {"factors", "base"}, scope="model"))
# Spectral and geometric merges
declare(MergeMethod("karcher", "mergeflow.merge.karcher:karcher", KarcherOptions, gram="inputs"))
declare(MergeMethod("tsv", "mergeflow.merge.tsv:tsv", TsvOptions, {"base"}))
declare(MergeMethod("iso_c", "mergeflow.merge.isotropic:iso_c", IsoCOptions, {"base"}))
declare(MergeMethod("iso_cts", "mergeflow.merge.isotropic:iso_cts", IsoCtsOptions, {"base"}, models=(2, None)))


def validate_options(method: str, options: Mapping[str, object] | BaseModel | None = None) -> BaseModel:
    """Parse a method's options (:meth:`MergeMethod.parse`), raising ConfigError that names the method and key."""
    return DECLARED.lookup(method).parse(options)
