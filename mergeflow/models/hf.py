"""Hugging Face transformers as mergeflow models: a sequence classifier or causal LM over token-id tensors.

:class:`SequenceClassifier` wraps an ``AutoModelForSequenceClassification`` so that it takes one
``(N, L)`` tensor of right-padded token ids and returns ``(N, C)`` logits, like the MLPs. Every
trainer, Fisher, merge and federated algorithm of mergeflow then runs on it unchanged.
:class:`CausalLM` wraps an ``AutoModelForCausalLM`` the same way and returns ``(N, L, V)`` next-token
logits; both are a :class:`TokenModel` (neither is the other). The wrapper builds the 4-D additive
float attention mask itself: transformers' own 2-D mask path has data-dependent control flow that
``torch.func.vmap`` cannot trace, so per-example Fishers work.

Tied weights (GPT-2's ``lm_head`` is its token embedding ``wte``) appear once in a wrapper's
``state_dict``, under the parameter's own name: every merge then combines one tensor, and loading
fills the tied key from it.

A spec (JSON, stored in every checkpoint's header) holds the full ``config.to_dict()``, so a
checkpoint rebuilds without the directory or hub name the base model came from.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mergeflow.models.family import ModelFamily
from mergeflow.models.token_model import TokenModel
from mergeflow.schema.families import is_causal

HF_TASKS = ("sequence_classification", "causal_lm")
# Config fields that hold a dropout probability, across BERT-, RoBERTa-, DistilBERT- and GPT-2-style configs.
_DROPOUT_FIELDS = (
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "classifier_dropout",
    "dropout",
    "attention_dropout",
    "seq_classif_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "summary_first_dropout",
)
_INIT_LOCK = threading.Lock()


class SequenceClassifier(TokenModel):
    """A ``…ForSequenceClassification`` over right-padded token ids: ``(N, classes)`` logits."""


class CausalLM(TokenModel):
    """A transformers causal LM over right-padded token ids: ``(N, L, V)`` next-token logits (the
    ``causal_lm`` objective scores it by its per-row token NLL)."""


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """transformers initialises weights from the global RNG: fork it, seed it, one build at a time."""
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        yield


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' own log at errors only, meanwhile (builds hold ``_INIT_LOCK``, one at a time)."""
    from transformers.utils import logging

    before = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(before)


def _config_from_dict(values: dict[str, Any]):
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[values["model_type"]].from_dict(values)


def _set_dropout(config: Any, dropout: float) -> None:
    for name in _DROPOUT_FIELDS:
        if hasattr(config, name):
            setattr(config, name, float(dropout))


def build_base(
    *,
    pretrained: str | None,
    config: dict[str, Any],
    num_labels: int,
    vocab_size: int,
    max_length: int,
    pad_token_id: int,
    sep_token_id: int | None,
    dropout: float,
    seed: int,
    class_names: list[str] | None = None,
    task: str = "sequence_classification",
) -> tuple[TokenModel, dict[str, Any]]:
    """The base model and its spec: pretrained weights with a new, seeded head, or a seeded random init.

    Args:
        pretrained: a local model directory or hub name; None builds from ``config``.
        config: for a from-scratch model, ``model_type`` (``bert``, ``gpt2``, …) and its sizes;
            with ``pretrained``, fields to override in the pretrained config.
        num_labels: classes of the head.
        vocab_size: the tokenizer's vocabulary (sizes the embeddings of a from-scratch model).
        max_length: the longest input, in tokens (sizes position embeddings of a from-scratch model).
        pad_token_id, sep_token_id: as in :class:`TokenModel`; the config's other special
            ids (beginning and end of text) become ``sep_token_id`` or the padding id.
        dropout: every dropout probability of the config (0 keeps training reproducible in threads:
            dropout draws from the global RNG).
        seed: seed of the random init (the head of a pretrained model, everything otherwise).
        class_names: the labels' names, kept in the config (``id2label``) for reloaded models.
        task: one of :data:`HF_TASKS`; ``causal_lm`` builds a :class:`CausalLM` (no new head, no labels).
    """
    from transformers import AutoConfig

    overrides = {k: v for k, v in config.items() if k != "model_type"}
    if pretrained:
        hf_config = AutoConfig.from_pretrained(pretrained, num_labels=num_labels, **overrides)
    else:
        # A from-config model's default special ids (GPT-2's 50256) may lie outside the trained vocabulary.
        special = int(pad_token_id if sep_token_id is None else sep_token_id)
        sizes = {"vocab_size": vocab_size, "max_position_embeddings": max_length, "n_positions": max_length}
        sizes |= {"pad_token_id": pad_token_id, "bos_token_id": special, "eos_token_id": special}
        hf_config = AutoConfig.for_model(config["model_type"], num_labels=num_labels, **sizes, **overrides)
    hf_config.pad_token_id = int(pad_token_id)
    if class_names and task == "sequence_classification":
        hf_config.id2label = dict(enumerate(class_names))
        hf_config.label2id = {name: i for i, name in enumerate(class_names)}
    hf_config._attn_implementation = "eager"
    _set_dropout(hf_config, dropout)
    model_class = auto_class(task)
    with seeded(seed):
        if pretrained:
            # A new head (another number of classes) replaces the checkpoint's; the body must load as it is.
            with _quiet_transformers():  # its load report lists the new head as missing, which it is by design
                model, report = model_class.from_pretrained(
                    pretrained, config=hf_config, ignore_mismatched_sizes=True, output_loading_info=True
                )
            prefix = f"{model.base_model_prefix}."
            body = [key for key, *_ in report["mismatched_keys"] if str(key).startswith(prefix)]
            if body:
                raise ValueError(f"{pretrained}: the config overrides change the pretrained body ({body[0]}, …)")
            missing = sorted(str(key) for key in report["missing_keys"] if str(key).startswith(prefix))
            if missing:
                warnings.warn(
                    f"{pretrained}: {len(missing)} tensors of the pretrained body are not in the checkpoint and "
                    f"start from the seeded init ({missing[0]}, …)",
                    stacklevel=2,
                )
        else:
            model = model_class.from_config(hf_config)
    spec = {
        "arch": "transformers",
        "input_shape": [int(max_length)],
        "output_dim": int(num_labels),
        "hf_config": hf_config.to_dict(),
        "pad_token_id": int(pad_token_id),
        "sep_token_id": sep_token_id,
        "causal": is_causal(hf_config.model_type),
        "seed": int(seed),
    } | ({"hf_task": task} if task != "sequence_classification" else {})
    return _wrapper(task)(model.float(), pad_token_id, sep_token_id, spec["causal"]), spec


def auto_class(task: str):
    """transformers' auto class of a task of :data:`HF_TASKS`."""
    import transformers

    if task not in HF_TASKS:
        raise ValueError(f"model.transformers.task must be one of {HF_TASKS}, got {task!r}")
    name = "AutoModelForCausalLM" if task == "causal_lm" else "AutoModelForSequenceClassification"
    return getattr(transformers, name)


def _wrapper(task: str) -> type[TokenModel]:
    return CausalLM if task == "causal_lm" else SequenceClassifier


def build_from_hf_spec(spec: dict[str, Any]) -> TokenModel:
    """The architecture of an ``arch: transformers`` spec (seeded init; a checkpoint's weights then load over it)."""
    task = spec.get("hf_task", "sequence_classification")
    config = _config_from_dict(spec["hf_config"])
    config._attn_implementation = "eager"
    with seeded(spec["seed"]):
        model = auto_class(task).from_config(config)
    return _wrapper(task)(model.float(), spec["pad_token_id"], spec["sep_token_id"], spec["causal"])


def head_names(model: nn.Module) -> list[str]:
    """Parameter names of a transformers classifier outside its base model (the head: ``classifier``, ``score``)."""
    prefix = f"{model.base_model_prefix}."
    return [name for name, _ in model.named_parameters() if not name.startswith(prefix)]


def transformers_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A :class:`TokenModel` state dict with transformers' own key names."""
    return {key.removeprefix("model."): value for key, value in state.items()}


def save_pretrained(
    spec: dict[str, Any], state: dict[str, torch.Tensor], directory: str | Path, tokenizer_dir: str | Path | None
) -> None:
    """Write a directory that ``AutoModelForSequenceClassification`` (``…ForCausalLM``) ``.from_pretrained`` reloads.

    The weights (safetensors), the config, and the tokenizer beside them when given.
    """
    model = build_from_hf_spec(spec)
    model.load_state_dict(state)
    directory = Path(directory)
    model.model.save_pretrained(directory, safe_serialization=True)
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(directory)


class TransformersFamily(ModelFamily):
    """Hugging Face transformers over token ids (``model.arch: transformers``): a sequence classifier or a causal LM,
    exported as a directory that ``from_pretrained`` reloads, with its tokenizer."""

    def build_base(
        self, model: dict[str, Any], info: dict[str, Any], output_dim: int, seed: int
    ) -> tuple[nn.Module, dict[str, Any]]:
        tokens, options = info["tokenizer"], self.declaration.Options.model_validate(model["transformers"])
        return build_base(
            pretrained=options.pretrained,
            config=options.model_config_fields(),
            num_labels=info["num_classes"],
            vocab_size=tokens["vocab_size"],
            max_length=tokens["max_length"],
            pad_token_id=tokens["pad_token_id"],
            sep_token_id=tokens["sep_token_id"] if info.get("pair") else None,
            dropout=options.dropout,
            seed=seed,
            class_names=info["class_names"],
            task=options.task,
        )

    def from_spec(self, spec: dict[str, Any]) -> nn.Module:
        return build_from_hf_spec(spec)

    def head_names(self, spec: dict[str, Any]) -> tuple[str, ...]:
        """A sequence classifier's parameters outside its base model, under the wrapper's ``model.`` prefix; a causal
        LM's none (its output layer is the vocabulary's, which every task shares)."""
        task = spec.get("hf_task", "sequence_classification")
        if task == "causal_lm":
            return ()
        config = _config_from_dict(spec["hf_config"])
        with torch.device("meta"):  # names only: no weights, no memory
            model = auto_class(task).from_config(config)
        return tuple(f"model.{name}" for name in head_names(model))

    def with_outputs(self, spec: dict[str, Any], output_dim: int, seed: int | None = None) -> dict[str, Any]:
        if not self.head_names(spec):
            return spec
        config = _config_from_dict(spec["hf_config"])
        # The new head's classes are not the old head's: their names (id2label) go with it.
        config.id2label = {i: f"LABEL_{i}" for i in range(int(output_dim))}
        config.label2id = {name: i for i, name in config.id2label.items()}
        outputs = {"output_dim": int(output_dim), "hf_config": config.to_dict()}
        return spec | outputs | ({} if seed is None else {"seed": int(seed)})

    def export(
        self, spec: dict[str, Any], state: dict[str, torch.Tensor], directory: Path, inputs: dict[str, Path]
    ) -> None:
        save_pretrained(spec, state, directory, inputs.get("tokenizer"))
