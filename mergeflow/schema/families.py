"""What params can say about each model family: the ``model.arch`` values it builds and what it supports.

Torch-free on purpose, like :mod:`mergeflow.schema.merge`: the params schema imports these
declarations, never the families' code (:mod:`mergeflow.models`), which imports torch. A new family
is one declaration here and one class there, registered with
:func:`mergeflow.models.family.register_family`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from mergeflow.errors import ConfigError, did_you_mean


@dataclass(frozen=True)
class FamilyDeclaration:
    """A model family as the params see it.

    Attributes:
        name: the family's name, and the name of its options section (``model.<name>``) if it has one.
        archs: the ``model.arch`` values (and checkpoint specs' ``arch``) it builds; the first is the
            name new specs carry, the others are read too.
        inputs: what its models take: ``features`` (float arrays) or ``tokens`` (token ids of a text source).
        aligns: whether permutation alignment (``align.method``) applies to its models (for transformers:
            those whose ``model_type`` is in :data:`ALIGNABLE_MODEL_TYPES`).
        repairs: whether REPAIR (``align.repair``) applies: its units' statistics can be rescaled by
            folding a per-unit affine map into the layer that produces them.
        align_defaults: the family's defaults for the ``align`` keys left unset (``null``): the
            examples and points that suit its models' cost per forward pass.
        backpack: whether BackPACK covers its modules (``fisher.backend: backpack``).
        language_models: whether it supports language-model pre-training and LoRA adapters.
        flavour: how MLflow logs its merged models: ``pyfunc`` over the user's raw rows, or
            ``transformers`` (a pipeline, from the exported directory).
        exports: whether a merged model is also written as a directory its ecosystem loads.
        extra_inputs: prepared artifacts its merge steps read besides the checkpoints (``tokenizer``).
        pretrained_key: the params key naming a pretrained model it starts from (a directory or hub
            name, checked before any work), if it has one.
        aliases: older names of its archs and of its section, still read from checkpoint specs and accepted
            in params with a one-line deprecation notice.
        objective: the objective its options choose (e.g. a causal LM), or None for the data's own.
        check: rules that span sections for this family (raises ``ValueError`` naming the key).
    """

    name: str
    archs: tuple[str, ...]
    inputs: Literal["features", "tokens"]
    aligns: bool
    backpack: bool
    language_models: bool
    flavour: Literal["pyfunc", "transformers"]
    exports: bool = False
    repairs: bool = False
    align_defaults: dict[str, int] = field(default_factory=dict, hash=False)
    extra_inputs: tuple[str, ...] = ()
    pretrained_key: str | None = None
    aliases: tuple[str, ...] = ()
    objective: Callable[[Any], str | None] = lambda model: None
    check: Callable[[Any], None] = lambda params: None


DECLARED: dict[str, FamilyDeclaration] = {}

# transformers model types with a permutation spec (mergeflow.align.transformer_spec.SPEC_BUILDERS).
ALIGNABLE_MODEL_TYPES = ("bert", "gpt2")


def declare_family(declaration: FamilyDeclaration) -> FamilyDeclaration:
    """Add a family's declaration (its name and every arch once)."""
    taken = {arch for family in DECLARED.values() for arch in family.archs}
    if declaration.name in DECLARED or taken & set(declaration.archs):
        raise ValueError(f"model family {declaration.name!r} (archs {declaration.archs}) is declared twice")
    DECLARED[declaration.name] = declaration
    return declaration


def family_of_arch(arch: str) -> FamilyDeclaration:
    """The declaration of the family that builds ``arch`` (a ``model.arch`` value or a spec's ``arch``).

    Raises:
        ConfigError: naming the known archs.
    """
    for declaration in DECLARED.values():
        if arch in declaration.archs or arch in declaration.aliases:
            return declaration
    known = [arch for family in DECLARED.values() for arch in family.archs]
    raise ConfigError([f"model.arch: {arch!r} is unknown{did_you_mean(arch, known)}; known: {', '.join(known)}"])


def check_alignable(model_type: str) -> None:
    """Raise ``ValueError`` (naming ``align.method``) unless a transformers model type has a permutation spec."""
    if model_type not in ALIGNABLE_MODEL_TYPES:
        raise ValueError(
            f"align.method: transformers model_type {model_type!r} has no permutation spec (alignment supports "
            f"{', '.join(ALIGNABLE_MODEL_TYPES)}); set align.method: none"
        )


def _transformers_objective(model: Any) -> str | None:
    return "causal_lm" if model.transformers.task == "causal_lm" else None


def _check_transformers(params: Any) -> None:
    """A from-config model's embeddings cover the tokenizer; a causal LM is a decoder."""
    options = params.model.transformers
    if not options.pretrained:
        embeddings = options.model_config_fields().get("vocab_size")
        if embeddings is not None and embeddings < params.data.tokenizer.vocab_size:
            raise ValueError(
                f"model.transformers.config.vocab_size: {embeddings} embeddings for a tokenizer of up to "
                f"{params.data.tokenizer.vocab_size} tokens (data.tokenizer.vocab_size); leave it out, and the "
                "model takes the tokenizer's size"
            )
    model_type = options.model_config_fields().get("model_type")
    if params.align.method != "none" and model_type is not None:
        check_alignable(model_type)
    if options.task == "causal_lm" and model_type is not None:
        from mergeflow.models.hf import is_causal

        if not is_causal(model_type):
            raise ValueError(
                "model.transformers.task: causal_lm needs a decoder (gpt2, llama, …); "
                f"config.model_type is {model_type!r}"
            )


declare_family(
    FamilyDeclaration(
        "sequential",
        archs=("linear", "mlp", "cnn"),
        inputs="features",
        aligns=True,
        backpack=True,
        language_models=False,
        flavour="pyfunc",
        repairs=True,
        align_defaults={"examples": 512, "barrier_points": 11, "barrier_examples": 1024},
    )
)
declare_family(
    FamilyDeclaration(
        "transformers",
        archs=("transformers",),
        aliases=("hf",),
        inputs="tokens",
        aligns=True,
        backpack=False,
        language_models=True,
        flavour="transformers",
        # A forward pass over a sequence costs what hundreds of MLP rows do: fewer rows and points.
        align_defaults={"examples": 256, "barrier_points": 5, "barrier_examples": 256},
        exports=True,
        extra_inputs=("tokenizer",),
        pretrained_key="model.transformers.pretrained",
        objective=_transformers_objective,
        check=_check_transformers,
    )
)
