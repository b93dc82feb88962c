"""What params can say about each objective (what a model is trained for): its metrics and the rules
that span sections.

Torch-free on purpose, like :mod:`mergeflow.schema.merge`: the params schema imports these
declarations, never the objectives' code (``mergeflow.objectives``), which imports torch. An
objective is one declaration here plus the module its ``implementation`` names (an
:class:`~mergeflow.objectives.base.Objective`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mergeflow.registry import Member, Registry


@dataclass(frozen=True)
class ObjectiveDeclaration(Member):
    """An objective as the params see it.

    Attributes:
        name: the objective's name (``Params.objective``, ``info["task"]``).
        rank_by: the test metric that ranks models (best client); which way it improves is
            :func:`mergeflow.metric_direction.lower_is_better`'s.
        headline: the metric plotted beside the NLL in the comparison plot.
        select_by: the validation metrics ``merge.select_by`` may choose on; the first is ``auto``'s.
        fisher_kinds: the ``fisher.kind`` values it supports.
        ensembles: whether several models' outputs combine into one (an output ensemble, a Bayesian
            model average over posterior draws).
        trains_language_model: whether the pretrain step already trains a language model (so
            ``pretrain.language_model`` would repeat it).
        implementation: its :class:`~mergeflow.objectives.base.Objective` class, as ``"module:attr"``.
    """

    name: str
    rank_by: str
    headline: str
    select_by: tuple[str, ...]
    implementation: str = ""
    fisher_kinds: tuple[str, ...] = ("empirical", "sampled", "exact")
    ensembles: bool = True
    trains_language_model: bool = False


DECLARED: Registry[ObjectiveDeclaration] = Registry("objective")


def declared_objective(name: str) -> ObjectiveDeclaration:
    """The declaration of objective ``name``.

    Raises:
        ConfigError: naming the known objectives.
    """
    return DECLARED.lookup(name)


DECLARED.declare(ObjectiveDeclaration(
    "classification", rank_by="accuracy", headline="accuracy", select_by=("accuracy", "nll"),
    implementation="mergeflow.objectives.classification:Classification",
))  # fmt: skip
DECLARED.declare(ObjectiveDeclaration(
    "regression", rank_by="mse", headline="mse", select_by=("nll", "mse"),
    implementation="mergeflow.objectives.regression:Regression",
))  # fmt: skip
DECLARED.declare(ObjectiveDeclaration(
    "causal_lm", rank_by="nll", headline="perplexity", select_by=("nll",),
    fisher_kinds=("empirical", "sampled"),  # exact sums over the vocabulary at every position
    ensembles=False,  # its outputs are per-row NLLs, not token distributions
    trains_language_model=True,
    implementation="mergeflow.objectives.causal_lm:CausalLM",
))  # fmt: skip
