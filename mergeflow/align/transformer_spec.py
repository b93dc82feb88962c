"""Permutation specs of transformers: BERT-style encoders and GPT-2-style decoders.

A transformer block has three kinds of hidden units that can be permuted without changing the
function (Verma & Elbayad 2024, "Merging Text Transformer Models from Different Initializations"):

- each layer's **MLP units**: the rows of the first projection and its bias, the columns of the second;
- each layer's **attention heads**, whole: a head's ``head_dim`` rows of the query, key and value
  projections (and biases) move together, and so do its ``head_dim`` columns of the output
  projection; attention is computed per head, so reordering heads only reorders the concatenation;
- the **residual stream**: one permutation of the hidden size shared by everything that reads or
  writes it: the embeddings' columns, every LayerNorm's weight and bias (its mean and variance are
  over all features, so a permutation commutes with it), the input columns of every projection that
  reads the stream and the output rows (and biases) of every projection that writes it, and the
  input columns of the head. A tied output layer (GPT-2's ``lm_head``, which *is* ``wte``) follows
  the embedding it shares; it is not a separate key of the state dict.

The residual stream is permuted only when the model's outputs are not in its basis, i.e. when a head
(pooler and classifier, ``score``, ``lm_head``) reads it; a bare ``BertModel`` or ``GPT2Model``
returns the stream itself and keeps it.

GPT-2 stores its projections as transformers' ``Conv1D``, weight ``(in, out)``: the transpose of
``nn.Linear``, so its output units are the weight's axis 1, and ``c_attn`` holds the query, key and
value projections side by side along that axis (a head's units repeat in each third).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from mergeflow.align.permute import apply_permutation, random_permutation
from mergeflow.align.spec import AxisRef, PermGroup, PermutationSpec, Probe

_SEQ = 2  # the feature axis of a (batch, positions, features) activation


def _hf_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The transformers model and the prefix of its keys in ``model``'s state dict (a wrapper's ``model.``)."""
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module) and hasattr(inner, "config"):
        return inner, "model."
    if not hasattr(model, "config"):
        raise ValueError(f"{type(model).__name__} is not a transformers model")
    return model, ""


def _base(hf: nn.Module, prefix: str, attribute: str) -> str:
    """Key prefix of the base model: ``bert.`` inside a model with a head, nothing for the bare model."""
    return f"{prefix}{attribute}." if isinstance(getattr(hf, attribute, None), nn.Module) else prefix


def _axes(*entries: tuple) -> tuple[AxisRef, ...]:
    return tuple(AxisRef(*entry) for entry in entries)


def _norm(module: str) -> tuple[AxisRef, ...]:
    """A LayerNorm's weight and bias."""
    return _axes((f"{module}.weight", 0), (f"{module}.bias", 0))


def _writes(module: str, out_axis: int, block: int = 1, repeat: int = 1) -> tuple[AxisRef, ...]:
    """A projection's output units: its weight's output axis (0 for ``nn.Linear``, 1 for ``Conv1D``) and bias."""
    return _axes((f"{module}.weight", out_axis, block, repeat), (f"{module}.bias", 0, block, repeat))


def _mlp(size: int, up: str, down: str, out_axis: int) -> PermGroup:
    """An MLP's hidden units: the first projection's outputs, the second's inputs (seen at its input)."""
    return PermGroup(
        size, (*_writes(up, out_axis), AxisRef(f"{down}.weight", 1 - out_axis)), Probe(down, _SEQ, point="input")
    )


def _bert(hf: nn.Module, prefix: str, residual: bool | None) -> dict[str, PermGroup]:
    config = hf.config
    base = _base(hf, prefix, "bert")
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = hidden // heads
    has_pooler = getattr(getattr(hf, "bert", hf), "pooler", None) is not None
    classifier = isinstance(getattr(hf, "classifier", None), nn.Linear) and has_pooler
    groups: dict[str, PermGroup] = {}
    stream: list[AxisRef] = []
    stream_probes = [Probe(f"{base}embeddings.LayerNorm", _SEQ)]
    emb = f"{base}embeddings."
    stream += [
        *(AxisRef(f"{emb}{table}_embeddings.weight", 1) for table in ("word", "position", "token_type")),
        *_norm(f"{emb}LayerNorm"),
    ]
    for layer in range(config.num_hidden_layers):
        at = f"{base}encoder.layer.{layer}."
        qkv = [f"{at}attention.self.{name}" for name in ("query", "key", "value")]
        out, inter, down = f"{at}attention.output.", f"{at}intermediate.dense", f"{at}output."
        groups[f"layer_{layer}.heads"] = PermGroup(
            heads,
            (*[ref for m in qkv for ref in _writes(m, 0, head_dim)], AxisRef(f"{out}dense.weight", 1, head_dim)),
            Probe(f"{out}dense", _SEQ, head_dim, True, "input"),
        )
        groups[f"layer_{layer}.mlp"] = _mlp(config.intermediate_size, inter, f"{down}dense", 0)
        stream += [
            *(AxisRef(f"{m}.weight", 1) for m in qkv),
            *_writes(f"{out}dense", 0),
            *_norm(f"{out}LayerNorm"),
            AxisRef(f"{inter}.weight", 1),
            *_writes(f"{down}dense", 0),
            *_norm(f"{down}LayerNorm"),
        ]
        stream_probes += [Probe(f"{out}LayerNorm", _SEQ), Probe(f"{down}LayerNorm", _SEQ)]
    if classifier:
        pooler = f"{base}pooler.dense"
        stream.append(AxisRef(f"{pooler}.weight", 1))
        groups["pooler"] = PermGroup(
            hidden,
            (*_writes(pooler, 0), AxisRef(f"{prefix}classifier.weight", 1)),
            Probe(f"{prefix}classifier", 1, point="input"),
        )
    if classifier if residual is None else residual:
        groups = {"residual": PermGroup(hidden, tuple(stream), tuple(stream_probes))} | groups
    return groups


def _gpt2(hf: nn.Module, prefix: str, residual: bool | None) -> dict[str, PermGroup]:
    config = hf.config
    base = _base(hf, prefix, "transformer")
    hidden, heads = config.n_embd, config.n_head
    head_dim = hidden // heads
    inner = config.n_inner or 4 * hidden
    groups: dict[str, PermGroup] = {}
    stream = list(_axes((f"{base}wte.weight", 1), (f"{base}wpe.weight", 1)))
    stream_probes = []
    for layer in range(config.n_layer):
        at = f"{base}h.{layer}."
        attn, mlp = f"{at}attn.", f"{at}mlp."
        groups[f"layer_{layer}.heads"] = PermGroup(
            heads,
            (*_writes(f"{attn}c_attn", 1, head_dim, 3), AxisRef(f"{attn}c_proj.weight", 0, head_dim)),
            Probe(f"{attn}c_proj", _SEQ, head_dim, True, "input"),
        )
        groups[f"layer_{layer}.mlp"] = _mlp(inner, f"{mlp}c_fc", f"{mlp}c_proj", 1)
        stream += [
            *_norm(f"{at}ln_1"),
            AxisRef(f"{attn}c_attn.weight", 0),
            *_writes(f"{attn}c_proj", 1),
            *_norm(f"{at}ln_2"),
            AxisRef(f"{mlp}c_fc.weight", 0),
            *_writes(f"{mlp}c_proj", 1),
        ]
        # Pre-LN: the stream itself is what enters each LayerNorm.
        stream_probes += [Probe(f"{at}ln_1", _SEQ, point="input"), Probe(f"{at}ln_2", _SEQ, point="input")]
    stream += _norm(f"{base}ln_f")
    stream_probes.append(Probe(f"{base}ln_f", _SEQ, point="input"))
    head = f"{prefix}score.weight" if isinstance(getattr(hf, "score", None), nn.Linear) else None
    lm_head = getattr(hf, "lm_head", None)
    if isinstance(lm_head, nn.Linear) and lm_head.weight is not hf.get_input_embeddings().weight:
        head = f"{prefix}lm_head.weight"  # a tied lm_head is wte: permuted with it, not a key of its own
    has_head = head is not None or isinstance(lm_head, nn.Linear)
    if head is not None:
        stream.append(AxisRef(head, 1))
    if has_head if residual is None else residual:
        groups = {"residual": PermGroup(hidden, tuple(stream), tuple(stream_probes))} | groups
    return groups


SPEC_BUILDERS: dict[str, Callable[[nn.Module, str, bool | None], dict[str, PermGroup]]] = {
    "bert": _bert,
    "gpt2": _gpt2,
}


def transformer_spec(model: nn.Module, *, residual: bool | None = None, check: bool = True) -> PermutationSpec:
    """The permutation groups of a BERT-style encoder or GPT-2-style decoder (or a wrapper of one).

    Groups: ``residual`` (when permuted), then per layer ``layer_L.heads`` (``num_heads`` units of
    ``head_dim``) and ``layer_L.mlp``, then BERT's ``pooler``. Every group carries probes for
    activation matching: heads are observed at the output projection's input (the concatenated
    heads, matched by their features), MLP units at the second projection's input, the residual
    stream wherever it enters or leaves a LayerNorm.

    Args:
        model: a transformers ``BertModel``/``Bert…`` or ``GPT2Model``/``GPT2…`` model, or a
            :class:`~mergeflow.models.token_model.TokenModel` wrapping one.
        residual: permute the residual stream; by default only when a head reads it (the model's
            outputs are logits, not the stream itself).
        check: verify in float64 that a random permutation from the spec leaves the logits unchanged.

    Raises:
        ValueError: for a model type without a spec (naming the ones that have one), or a failed check.
    """
    hf, prefix = _hf_model(model)
    model_type = hf.config.model_type
    if model_type not in SPEC_BUILDERS:
        raise ValueError(
            f"no permutation spec for transformers model_type {model_type!r}; alignment supports "
            f"{', '.join(SPEC_BUILDERS)}"
        )
    groups = SPEC_BUILDERS[model_type](hf, prefix, residual)
    state = model.state_dict()
    missing = sorted({ref.key for g in groups.values() for ref in g.axes} - set(state))
    if missing:
        raise ValueError(f"the {model_type} spec names keys the model lacks: {missing[:3]}")
    spec = PermutationSpec(groups)
    if check:
        verify_transformer_spec(model, spec)
    return spec


def _moving_permutation(spec: PermutationSpec, seed: int) -> dict[str, torch.Tensor]:
    """A random permutation of every group that moves at least one unit of each (of two or more)."""
    perms = random_permutation(spec, seed)
    return {
        name: p.roll(1) if torch.equal(p, torch.arange(len(p), device=p.device)) else p for name, p in perms.items()
    }


def verify_transformer_spec(model: nn.Module, spec: PermutationSpec, *, seed: int = 0) -> None:
    """Raise ``ValueError`` unless a random permutation from ``spec`` keeps ``model``'s outputs (eval
    mode, float64, on random token ids with some padding when the model masks it)."""
    probe = copy.deepcopy(model).to(torch.float64).eval()
    hf, _ = _hf_model(probe)
    config = hf.config
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 8)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (3, min(8, positions)), generator=gen, device=gen.device)
    pad = getattr(probe, "pad_token_id", None)
    if pad is not None:
        ids[ids == pad] = (pad + 1) % config.vocab_size
        ids[0, -2:] = pad
    device = next(probe.parameters()).device
    state = probe.state_dict()

    def outputs() -> torch.Tensor:
        out = probe(ids.to(device))
        return out if isinstance(out, torch.Tensor) else out[0]

    with torch.no_grad():
        before = outputs()
        probe.load_state_dict(apply_permutation(spec, state, _moving_permutation(spec, seed)))
        after = outputs()
    scale = float(before.abs().max()) + 1.0
    if not torch.allclose(after, before, rtol=1e-7, atol=1e-9 * scale):
        raise ValueError(
            f"permuting the groups of the {config.model_type} spec changes the model's outputs "
            f"(by up to {float((after - before).abs().max()):.3g})"
        )
