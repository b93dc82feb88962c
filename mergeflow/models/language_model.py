"""Language-model pre-training of a :class:`~mergeflow.models.hf.TokenModel`'s body on unlabelled text.

A from-config transformer knows no language. Before it learns the task, :func:`pretrain_language_model`
trains a masked-LM (BERT-style: 15% of the tokens chosen, 80% of them masked, 10% replaced by a random
token, 10% kept) or causal-LM (GPT-style: next token) head on the same body, then hands the body back
to the classifier. Masks, replacements and batch order come from one seeded generator, so the same
seed gives the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mergeflow import cancel
from mergeflow.device import module_device, to_device
from mergeflow.models.hf import seeded
from mergeflow.models.token_model import TokenModel
from mergeflow.objectives.causal_lm import IGNORE_INDEX, next_token_labels, token_cross_entropy
from mergeflow.training import DivergenceError, minibatches

LM_OBJECTIVES = ("mlm", "clm")


@dataclass(frozen=True)
class SpecialIds:
    """Token ids the objectives must know: padding, the mask token, and ids never masked or predicted."""

    pad: int
    mask: int | None
    never_masked: tuple[int, ...]


def mask_tokens(
    ids: torch.Tensor, special: SpecialIds, vocab_size: int, generator: torch.Generator, probability: float = 0.15
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: ``(inputs, labels)`` with labels -100 everywhere but at the chosen tokens."""
    if special.mask is None:
        raise ValueError("masked-LM pre-training needs a tokenizer with a mask token")
    candidates = ~torch.isin(ids, torch.tensor([special.pad, *special.never_masked], device=ids.device))
    on = {"device": generator.device}  # drawn where the generator is, then moved to the ids

    chosen = candidates & (torch.rand(ids.shape, generator=generator, **on).to(ids.device) < probability)
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    draw = torch.rand(ids.shape, generator=generator, **on).to(ids.device)
    inputs = torch.where(chosen & (draw < 0.8), torch.full_like(ids, special.mask), ids)
    random_tokens = torch.randint(vocab_size, ids.shape, generator=generator, **on).to(ids.device)
    inputs = torch.where(chosen & (draw >= 0.8) & (draw < 0.9), random_tokens, inputs)
    return inputs, labels


def pretrain_language_model(
    classifier: TokenModel,
    ids: torch.Tensor,
    special: SpecialIds,
    *,
    objective: str,
    epochs: int,
    lr: float,
    batch_size: int = 32,
    mask_probability: float = 0.15,
    seed: int = 0,
) -> list[float]:
    """Train ``classifier``'s body as a language model on the token ids ``ids`` (N, L), in place.

    Returns the mean loss (over predicted tokens) of every epoch.

    Raises:
        DivergenceError: on a non-finite loss.
        ValueError: on an unknown objective, or masked-LM without a mask token.
    """
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    if objective not in LM_OBJECTIVES:
        raise ValueError(f"language-model objective must be one of {LM_OBJECTIVES}, got {objective!r}")
    body_name = classifier.model.base_model_prefix
    head_class = AutoModelForMaskedLM if objective == "mlm" else AutoModelForCausalLM
    with seeded(seed):
        lm = head_class.from_config(classifier.model.config)
    device = module_device(classifier)
    lm.to(device)
    _copy_body(getattr(classifier.model, body_name), getattr(lm, body_name))
    head = _MaskedPositionsHead.install(lm) if objective == "mlm" else None
    # The classifier's wrapper builds the masks (padding, and causal for decoders) and returns the LM's logits.
    wrapper = TokenModel(lm, classifier.pad_token_id, classifier.sep_token_id, classifier.causal)
    generator = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(lm.parameters(), lr=lr)
    lengths = (ids != special.pad).sum(1)
    vocab_size = lm.config.vocab_size
    history = []
    lm.train()
    for epoch in range(epochs):
        total, count = 0.0, 0
        for step, idx in enumerate(minibatches(len(ids), batch_size, generator, lengths)):
            cancel.check()
            batch = ids[idx]
            if objective == "mlm":
                inputs, labels = mask_tokens(batch, special, vocab_size, generator, mask_probability)
            else:
                inputs, labels = batch, next_token_labels(batch, special.pad)
            inputs, labels = to_device(inputs, device), to_device(labels, device)
            predicted = int((labels != IGNORE_INDEX).sum())
            if predicted == 0:
                continue
            if head is not None:
                head.positions = labels != IGNORE_INDEX
                loss = F.cross_entropy(wrapper(inputs), labels[head.positions])
            else:
                loss = token_cross_entropy(wrapper(inputs), labels)
            if not math.isfinite(loss.item()):
                raise DivergenceError(f"non-finite language-model loss at epoch {epoch}, step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total, count = total + loss.item() * predicted, count + predicted
        history.append(total / max(count, 1))
    _copy_body(getattr(lm, body_name), getattr(classifier.model, body_name))
    return history


class _MaskedPositionsHead(torch.nn.Module):
    """A masked-LM head that predicts only the masked positions (``positions``, set before each forward):
    the vocabulary projection of the other 85% of the tokens is work the loss never reads. The model's
    ``logits`` are then ``(masked tokens, vocabulary)``."""

    _HEADS = ("cls", "lm_head")  # BERT's and RoBERTa's masked-LM heads

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.head = head
        self.positions: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden[self.positions[:, : hidden.shape[1]]])

    @classmethod
    def install(cls, lm: torch.nn.Module) -> _MaskedPositionsHead | None:
        """Wrap ``lm``'s head in place; None (every position predicted) for an architecture not known here."""
        name = next((n for n in cls._HEADS if isinstance(getattr(lm, n, None), torch.nn.Module)), None)
        if name is None:
            return None
        wrapped = cls(getattr(lm, name))
        setattr(lm, name, wrapped)
        return wrapped


def _copy_body(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Load ``source``'s weights into ``target``; only a pooler (which masked-LM bodies lack) may differ."""
    result = target.load_state_dict(source.state_dict(), strict=False)
    stray = [key for key in [*result.missing_keys, *result.unexpected_keys] if not key.startswith("pooler.")]
    if stray:
        raise ValueError(f"the language-model body does not match the classifier's: {stray[:3]}")
