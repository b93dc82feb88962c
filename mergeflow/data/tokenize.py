"""Tokenization of text datasets: a pretrained model's own tokenizer, or one trained on the training split.

:func:`encode_dataset` turns the text layout (``text``, ``text_pair``, ``y``, ``group``) into the
numeric one (``x``, ``y``, ``group``) with ``x`` the right-padded token ids, ``max_length`` per row,
so every split, partition and trainer of mergeflow handles text like any other table.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from mergeflow.data.errors import DataError
from mergeflow.data.rows import wrap_table

if TYPE_CHECKING:  # datasets loads where it is used: planning a run does not need it
    import datasets

TOKENIZER_KINDS = ("bpe",)
_BATCH = 4096


def train_tokenizer(texts: Iterable[str], *, kind: str = "bpe", vocab_size: int = 8192, min_frequency: int = 2):
    """A byte-level BPE tokenizer (GPT-2's and RoBERTa's kind) trained with ``tokenizers`` on ``texts``.

    Returns a transformers fast tokenizer that frames a text as ``<s> a </s>`` and a pair as
    ``<s> a </s> b </s>``, with padding id 0. Byte-level BPE covers every input (no unknown
    token) and trains reproducibly; the WordPiece trainer of ``tokenizers`` does not (its vocabulary
    changes from run to run on the same texts), which would break same params, same weights.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind not in TOKENIZER_KINDS:
        raise DataError(f"tokenizer kind must be one of {', '.join(TOKENIZER_KINDS)}, got {kind!r}")
    specials = {"pad_token": "<pad>", "unk_token": "<unk>", "cls_token": "<s>", "sep_token": "</s>"}
    specials |= {"bos_token": "<s>", "eos_token": "</s>", "mask_token": "<mask>"}
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(dict.fromkeys(specials.values())),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    ids = {token: tokenizer.token_to_id(token) for token in ("<s>", "</s>")}
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=list(ids.items())
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **specials)


def load_tokenizer(path: str | Path):
    """A saved or pretrained tokenizer (a local directory, or a hub name when online)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as error:
        raise DataError(f"{path}: no tokenizer could be loaded ({error})".splitlines()[0]) from None
    if tokenizer.pad_token_id is None:  # GPT-2-style tokenizers have no padding token: pad with end-of-text
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_vocabulary(tokenizer: Any, model_path: str | Path, overrides: dict[str, Any] | None = None) -> None:
    """Raise :class:`DataError` when a tokenizer has ids beyond the model's embedding table.

    ``overrides`` are ``model.transformers.config``'s fields over the pretrained config (``vocab_size`` among them).
    """
    from transformers import AutoConfig

    size = (overrides or {}).get("vocab_size")
    if size is None:
        size = getattr(AutoConfig.from_pretrained(str(model_path)), "vocab_size", None)
    if size is not None and len(tokenizer) > size:
        raise DataError(
            f"{model_path}: the tokenizer has {len(tokenizer)} tokens but the model's embeddings hold {size}; "
            "use the tokenizer the model was trained with"
        )


def training_texts(ds: datasets.Dataset) -> Iterable[str]:
    """Every text of a text-layout dataset (both sides of a pair), in row order."""
    yield from ds["text"]
    if "text_pair" in ds.column_names:
        yield from ds["text_pair"]


def encode_dataset(ds: datasets.Dataset, tokenizer: Any, max_length: int) -> datasets.Dataset:
    """The numeric layout of a text dataset: ``x`` = token ids padded (right) or cut to ``max_length``."""
    if max_length < 1:
        raise DataError(f"max_length must be >= 1, got {max_length}")
    pairs = "text_pair" in ds.column_names
    rows = []
    for start in range(0, ds.num_rows, _BATCH):
        batch = ds[start : start + _BATCH]
        encoded = tokenizer(
            batch["text"],
            batch["text_pair"] if pairs else None,
            truncation=True,
            max_length=max_length,
            padding="max_length",
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        rows.append(np.asarray(encoded["input_ids"], dtype=np.int32))
    ids = np.concatenate(rows) if rows else np.zeros((0, max_length), dtype=np.int32)
    offsets = np.arange(len(ids) + 1, dtype=np.int32) * max_length
    columns: dict[str, pa.Array] = {
        "x": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids.ravel())),
        "y": ds.data.column("y").combine_chunks(),
    }
    if "group" in ds.column_names:
        columns["group"] = ds.data.column("group").combine_chunks()
    return wrap_table(pa.table(columns))


def tokenizer_facts(tokenizer: Any, max_length: int) -> dict[str, Any]:
    """What a model needs from its tokenizer: vocabulary size and the special ids, for ``info.json``."""
    return {
        "vocab_size": len(tokenizer),
        "pad_token_id": int(tokenizer.pad_token_id),
        "sep_token_id": None if tokenizer.sep_token_id is None else int(tokenizer.sep_token_id),
        "mask_token_id": None if tokenizer.mask_token_id is None else int(tokenizer.mask_token_id),
        "special_ids": sorted(int(i) for i in tokenizer.all_special_ids),
        "max_length": int(max_length),
    }
