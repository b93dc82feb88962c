"""A model over right-padded token ids (the explicit protocol of token inputs), torch only.

:class:`TokenModel` wraps a transformers model: it masks padding itself (a 4-D additive float mask,
which ``torch.func.vmap`` can trace), knows its padding id, and names its token-embedding table.
The trainers, the Fishers and the causal-LM objective ask ``isinstance(model, TokenModel)``, never
for attributes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TokenModel(nn.Module):
    """A transformers model over right-padded token ids: padding masked out, its logits returned.

    Attributes:
        model: the wrapped transformers model (its ``state_dict`` keys carry the prefix
            ``model.``; :func:`transformers_state` strips it).
        pad_token_id: the id that marks padding; padded positions are masked out.
        sep_token_id: for sentence pairs with segment embeddings, the separator id after which
            tokens get segment 1 (None: every token is segment 0).
    """

    def __init__(
        self, model: nn.Module, pad_token_id: int, sep_token_id: int | None = None, causal: bool = False
    ) -> None:
        super().__init__()
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.sep_token_id = None if sep_token_id is None else int(sep_token_id)
        self.causal = causal
        self.register_state_dict_post_hook(_drop_tied_aliases)
        self.register_load_state_dict_pre_hook(_fill_tied_aliases)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.long()
        # Data-dependent shapes break vmap (per-example Fishers) and torch.export (MLflow): trim only eagerly.
        if not (torch._C._functorch.is_functorch_wrapped_tensor(ids) or torch.compiler.is_compiling()):
            ids = trim_padding(ids, self.pad_token_id)
        keep = (ids != self.pad_token_id)[:, None, None, :]
        if self.causal:  # a 4-D mask replaces the model's own, so a decoder's causal part goes in too
            length = ids.shape[1]
            keep = keep & torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        dtype = next(self.model.parameters()).dtype
        # Under autocast the mask takes the attention's dtype: SDPA keeps its fused kernels, eager its bf16 scores.
        if torch.is_autocast_enabled(ids.device.type):
            dtype = torch.get_autocast_dtype(ids.device.type)
        mask = (1.0 - keep.to(dtype)) * torch.finfo(dtype).min
        extra = {}
        if self.sep_token_id is not None:
            is_sep = (ids == self.sep_token_id).long()
            extra["token_type_ids"] = ((is_sep.cumsum(1) - is_sep) >= 1).long()
        return self.model(input_ids=ids, attention_mask=mask, **extra).logits

    def token_embedding(self) -> tuple[str, nn.Embedding] | None:
        """The token-embedding table, its parameter name here and its module, when only the embedding
        uses it (sparse Fishers); None when it is tied to an output layer, whose gradient is dense."""
        module = self.model.get_input_embeddings()
        names = [
            name for name, parameter in self.named_parameters(remove_duplicate=False) if parameter is module.weight
        ]
        if len(names) != 1:
            return None
        return names[0], module


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """Parameter names that are another parameter (tied weights): {alias: the name ``named_parameters`` keeps}."""
    first: dict[int, str] = {}
    aliases = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            aliases[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return aliases


def _drop_tied_aliases(module: nn.Module, state: dict[str, Any], prefix: str, _metadata: Any) -> None:
    for alias in tied_aliases(module):
        state.pop(prefix + alias, None)


def _fill_tied_aliases(module: nn.Module, state: dict[str, Any], prefix: str, *_args: Any) -> None:
    for alias, source in tied_aliases(module).items():
        if prefix + alias not in state and prefix + source in state:
            state[prefix + alias] = state[prefix + source]


def trim_padding(ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Drop the trailing columns that are padding in every row (a batch runs at its own longest)."""
    used = (ids != pad_token_id).any(0)
    last = used.numel() - 1 - used.flip(0).to(torch.uint8).argmax()  # the last used column
    return ids[:, : int(torch.where(used.any(), last + 1, 1))]  # one host sync: the shape depends on the data
