"""What params can say about each model family: the ``model.arch`` values it builds, its options and what
it supports.

Torch-free on purpose, like :mod:`mergeflow.schema.merge`: the params schema imports these declarations,
never the families' code, which imports torch. A family is one :class:`FamilyDeclaration` subclass here,
declared with :func:`declare_family`, plus the module its ``implementation`` names (a
:class:`~mergeflow.models.family.ModelFamily`); its ``Options`` are the params section ``model.<name>``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mergeflow.errors import ConfigError, did_you_mean
from mergeflow.registry import Member, Registry


class FamilyDeclaration(Member):
    """A model family as the params see it (subclasses set these as class attributes).

    Attributes:
        name: the family's name, and the name of its options section (``model.<name>``).
        archs: the ``model.arch`` values (and checkpoint specs' ``arch``) it builds; the first is the
            name new specs carry, the others are read too.
        aliases: older names of its archs and of its section, still read from checkpoint specs and accepted
            in params with a one-line deprecation notice.
        Options: its options model, the section ``model.<name>``.
        inline_options: whether its options are keys of ``model`` itself (``model.widths``) instead.
        implementation: its :class:`~mergeflow.models.family.ModelFamily` class, as ``"module:attr"``.
        inputs: what its models take: ``features`` (float arrays) or ``tokens`` (token ids of a text source).
        permutation_spec: the function ``(model, spec) -> PermutationSpec`` that permutation alignment
            (``align.method``) applies to its models, as ``"module:attr"``; None where alignment does not apply.
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
    """

    archs: tuple[str, ...]
    inline_options: bool = False
    inputs: Literal["features", "tokens"]
    permutation_spec: str | None = None
    repairs: bool = False
    align_defaults: dict[str, int] = {}
    backpack: bool
    language_models: bool
    flavour: Literal["pyfunc", "transformers"]
    exports: bool = False
    extra_inputs: tuple[str, ...] = ()
    pretrained_key: str | None = None

    @property
    def aligns(self) -> bool:
        """Whether permutation alignment (``align.method``) applies to its models."""
        return self.permutation_spec is not None

    def options(self, model: BaseModel) -> BaseModel:
        """Its validated options in the validated ``model`` section (``model`` has no section for a family
        without options, nor for one declared after the params schema was built: its defaults then)."""
        if self.inline_options:
            return model
        section = getattr(model, self.name, None)
        return self.Options() if section is None else section

    def objective(self, options: Any) -> str | None:
        """The objective its ``options`` choose (a causal LM), or None for the data's own."""
        return None

    def options_in_use(self, options: BaseModel) -> dict[str, Any]:
        """Its ``options`` as a run uses them (what the tracked params show): as given, by default."""
        return options.model_dump(mode="json")

    def check(self, params: Any) -> None:
        """Rules that span sections for this family (``ValueError`` naming the key)."""


DECLARED: Registry[FamilyDeclaration] = Registry("model family")


def declare_family(cls: type[FamilyDeclaration]) -> type[FamilyDeclaration]:
    """Class decorator: declare one instance of ``cls`` (its name and every arch once)."""
    taken = {arch for family in DECLARED.values() for arch in family.archs}
    if taken & set(cls.archs):
        raise ValueError(f"model family {cls.name!r} (archs {cls.archs}) is declared twice")
    DECLARED.declare(cls())
    return cls


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


class SequentialOptions(BaseModel):
    """The MLP's hidden ``widths`` and ``activation`` (keys of ``model`` itself)."""

    model_config = ConfigDict(extra="forbid")
    widths: list[int] = [64]
    activation: Literal["relu", "tanh"] = "relu"

    @field_validator("widths")
    @classmethod
    def _positive_widths(cls, widths: list[int]) -> list[int]:
        if any(w < 1 for w in widths):
            raise ValueError("every width must be >= 1")
        return widths


@declare_family
class Sequential(FamilyDeclaration):
    """Linear, MLP and CNN models as plain ``nn.Sequential``."""

    name = "sequential"
    archs = ("linear", "mlp", "cnn")
    Options = SequentialOptions
    inline_options = True  # its keys predate the families' sections
    implementation = "mergeflow.models.sequential:SequentialFamily"
    inputs = "features"
    permutation_spec = "mergeflow.align.derive:traced_spec"
    repairs = True
    align_defaults = {"examples": 512, "barrier_points": 11, "barrier_examples": 1024}
    backpack = True
    language_models = False
    flavour = "pyfunc"

    def check(self, params: Any) -> None:
        """A CNN needs image-shaped rows."""
        data = params.data
        if params.model.arch == "cnn" and data.modality != "image" and data.declaration.shape_option is None:
            raise ValueError(f"model.arch: 'cnn' needs image-shaped data, and data.source {data.source!r} is not")


# A from-config model when model.transformers.config is not given: a 2-layer BERT, hidden 64 (about 0.6M parameters).
DEFAULT_HF_CONFIG = {
    "model_type": "bert",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 128,
}

# transformers model types with a permutation spec (mergeflow.align.transformer_spec.SPEC_BUILDERS).
ALIGNABLE_MODEL_TYPES = ("bert", "gpt2")


class TransformersOptions(BaseModel):
    """A Hugging Face transformers model (``model.arch: transformers``).

    ``pretrained``: a local model directory or a hub name (downloaded only when online); its own
    tokenizer is used and ``config`` (if given) overrides fields of its config. Without it, a model
    is built from ``config``: ``model_type`` (``bert``, ``gpt2``, ``roberta``, …) and its sizes
    (default :data:`DEFAULT_HF_CONFIG`), with a tokenizer trained on the training split
    (``data.tokenizer``). ``dropout`` sets every dropout
    probability of the config; dropout draws from torch's global RNG, so runs are bit-reproducible
    with it only when steps run one at a time (``orchestration.max_workers: 1``).
    """

    model_config = ConfigDict(extra="forbid")
    pretrained: str | None = None
    config: dict[str, Any] | None = None
    task: Literal["sequence_classification", "causal_lm"] = "sequence_classification"
    dropout: float = Field(0.0, ge=0, lt=1)

    def model_config_fields(self) -> dict[str, Any]:
        """The config to build from (a small BERT by default), or the overrides of a pretrained config."""
        if self.config is not None:
            return dict(self.config)
        return {} if self.pretrained else dict(DEFAULT_HF_CONFIG)

    @model_validator(mode="after")
    def _model_source(self) -> TransformersOptions:
        if not self.pretrained and "model_type" not in self.model_config_fields():
            raise ValueError("config.model_type: needed without a pretrained model (e.g. bert or gpt2)")
        return self


def check_alignable(model_type: str) -> None:
    """Raise ``ValueError`` (naming ``align.method``) unless a transformers model type has a permutation spec."""
    if model_type not in ALIGNABLE_MODEL_TYPES:
        raise ValueError(
            f"align.method: transformers model_type {model_type!r} has no permutation spec (alignment supports "
            f"{', '.join(ALIGNABLE_MODEL_TYPES)}); set align.method: none"
        )


def is_causal(model_type: str) -> bool:
    """Whether a model type attends only to the left (GPT-2, Llama, …): every type with no masked-LM head."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


@declare_family
class Transformers(FamilyDeclaration):
    """Hugging Face transformers over token ids: a sequence classifier or a causal LM."""

    name = "transformers"
    archs = ("transformers",)
    aliases = ("hf",)
    Options = TransformersOptions
    implementation = "mergeflow.models.hf:TransformersFamily"
    inputs = "tokens"
    permutation_spec = "mergeflow.align.derive:transformers_spec"
    # A forward pass over a sequence costs what hundreds of MLP rows do: fewer rows and points.
    align_defaults = {"examples": 256, "barrier_points": 5, "barrier_examples": 256}
    backpack = False
    language_models = True
    flavour = "transformers"
    exports = True
    extra_inputs = ("tokenizer",)
    pretrained_key = "model.transformers.pretrained"

    def options_in_use(self, options: BaseModel) -> dict[str, Any]:
        """The options with the model config it builds from (a small BERT's by default)."""
        return options.model_dump(mode="json") | {"config": options.model_config_fields()}

    def objective(self, options: Any) -> str | None:
        return "causal_lm" if options.task == "causal_lm" else None

    def check(self, params: Any) -> None:
        """A from-config model's embeddings cover the tokenizer; a causal LM is a decoder."""
        options = self.options(params.model)
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
        if options.task == "causal_lm" and model_type is not None and not is_causal(model_type):
            raise ValueError(
                "model.transformers.task: causal_lm needs a decoder (gpt2, llama, …); "
                f"config.model_type is {model_type!r}"
            )
