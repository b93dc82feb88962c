"""The training sections: ``pretrain``, ``finetune`` (with per-client overrides and LoRA), ``centralized``, and
the local training of federated rounds."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mergeflow.config.section import Section


class TrainOverride(Section):
    """Per-client changes to the fine-tuning defaults (as the SSF paper varies epochs and lr)."""

    epochs: int | None = Field(None, ge=0)
    lr: float | None = Field(None, gt=0)
    optimizer: Literal["sgd", "adam"] | None = None
    momentum: float | None = Field(None, ge=0, lt=1)
    weight_decay: float | None = Field(None, ge=0)
    batch_size: int | None = Field(None, ge=1)


class TrainConfig(Section):
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


class LanguageModelPretraining(Section):
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
    transformers, optionally language-model pre-training first (``language_model``). ``checkpoint``: a base given
    instead, used as it is (no init, no training): the path of a mergeflow checkpoint (a ``.safetensors`` file with
    its spec in the header, such as another run's ``models/base/base.safetensors``); its content keys the step. A
    transformer's pretrained Hugging Face directory or Hub name is ``model.transformers.pretrained`` instead (its
    body, with a new head for the data's labels)."""

    enabled: bool = True
    epochs: int = Field(20, ge=0)
    language_model: LanguageModelPretraining | None = None
    checkpoint: str | None = None


class LoraSettings(Section):
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
    checkpoints, Fishers and merges keep the model's dtype (float32) and their float64 sums.
    ``checkpoints``: clients given instead of trained, ``{client id: source}`` (the others are trained). A source is
    a mergeflow checkpoint (``.safetensors`` with its spec in the header), a local Hugging Face model directory
    (``config.json`` and ``model.safetensors`` or shards), a PEFT LoRA adapter directory on the run's base (folded
    into full weights), or a Hub name (downloaded when online); relative paths are read from the directory the
    command runs in. The files key the client's step: editing one re-runs what depends on it."""

    init: Literal["shared", "independent"] = "shared"
    on_divergence: Literal["fail", "exclude"] = "fail"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    lora: LoraSettings | None = None
    clients: dict[int, TrainOverride] = {}
    checkpoints: dict[int, str] = {}


class CentralizedConfig(Section):
    """The centralized oracle: every client's data pooled, trained from the base model with the
    fine-tuning settings for ``epochs`` (``finetune.epochs`` when unset). ``keep: best_validation``
    scores the validation split after every epoch and keeps the best epoch's weights (the
    parameter-averaging-laws paper compares with the centralized model at its best); it needs
    ``data.validation_fraction`` > 0. Test never chooses. In a multi-task run it is the ceiling: one body trained
    jointly on every task's pooled client data with a head per task. ``enabled: false`` leaves it out (a run
    that only merges given models trains nothing; a sweep whose other run already trained the same oracle on the
    same rows need not train it again); nothing is then reported against it."""

    enabled: bool = True
    epochs: int | None = Field(None, ge=1)
    keep: Literal["last", "best_validation"] = "last"


class LocalTrainConfig(TrainConfig):
    epochs: int = Field(2, ge=1)
