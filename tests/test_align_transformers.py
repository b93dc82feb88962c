"""Alignment of transformers: permutation specs of BERT- and GPT-2-style models (MLP units, whole heads,
the residual stream, tied embeddings) recover a permuted copy exactly, by weights and by activations."""

from __future__ import annotations

import json

import pytest
import torch

from mergeflow.align import (
    activation_matching,
    apply_permutation,
    compose_permutations,
    permute_grams,
    random_permutation,
    weight_matching,
)
from mergeflow.align.spec import PermutationSpec
from mergeflow.align.transformer_spec import SPEC_BUILDERS, transformer_spec, verify_transformer_spec
from mergeflow.grams import CONV1D, linear_input_grams
from mergeflow.models.hf import build_base
from mergeflow.registry import imported
from mergeflow.schema.families import ALIGNABLE_MODEL_TYPES, DECLARED

PAD = 0
CONFIGS = {
    "bert": {"model_type": "bert", "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 24},
    "gpt2": {"model_type": "gpt2", "n_embd": 16, "n_layer": 2, "n_head": 4, "n_inner": 24},
}  # fmt: skip
CASES = {
    "bert": ("bert", "sequence_classification"),
    "gpt2": ("gpt2", "sequence_classification"),
    "gpt2-lm": ("gpt2", "causal_lm"),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(case: str, seed: int = 0):
    """A tiny model whose every tensor is perturbed (LayerNorms and biases no longer at their init)."""
    model_type, task = CASES[case]
    model, _ = build_base(
        pretrained=None, config=CONFIGS[model_type], num_labels=3, vocab_size=40, max_length=12,
        pad_token_id=PAD, sep_token_id=None, dropout=0.0, seed=seed, task=task,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=gen))
    return model.eval()


def _ids(n: int = 24, seed: int = 1) -> torch.Tensor:
    """Random token ids with right padding of varying length."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 40, (n, 12), generator=gen)
    lengths = torch.randint(3, 13, (n,), generator=gen)
    ids[torch.arange(12)[None, :] >= lengths[:, None]] = PAD
    return ids


def _logits(model, state, ids) -> torch.Tensor:
    model.load_state_dict(state)
    with torch.no_grad():
        return model(ids)


def _moving(spec, seed: int) -> dict:
    """A random permutation of every group that moves some unit of each."""
    perms = random_permutation(spec, seed)
    return {name: p.roll(1) if _is_identity({name: p}) else p for name, p in perms.items()}


def _is_identity(perms) -> bool:
    return all(torch.equal(p, torch.arange(len(p))) for p in perms.values())


@pytest.mark.parametrize("case", list(CASES))
def test_a_permuted_copy_keeps_its_function_and_weight_matching_recovers_the_original(case):
    model = _model(case)
    spec = transformer_spec(model)
    sizes = {name: group.size for name, group in spec.groups.items()}
    assert sizes["residual"] == 16 and sizes["layer_1.heads"] == 4 and sizes["layer_0.mlp"] == 24
    state = {k: v.clone() for k, v in model.state_dict().items()}
    perms = _moving(spec, 5)
    permuted = apply_permutation(spec, state, perms)
    ids = _ids()
    torch.testing.assert_close(_logits(model, permuted, ids), _logits(model, state, ids), rtol=1e-5, atol=1e-5)
    result = weight_matching(spec, state, permuted, seed=0)
    assert result.converged and _is_identity(compose_permutations(perms, result.perms))
    aligned = apply_permutation(spec, permuted, result.perms)
    assert all(torch.equal(aligned[k], state[k]) for k in state)


@pytest.mark.parametrize("case", ["bert", "gpt2"])
def test_activation_matching_recovers_heads_mlp_units_and_the_residual_stream(case):
    model, other = _model(case), _model(case)
    spec = transformer_spec(model)
    perms = _moving(spec, 9)
    other.load_state_dict(apply_permutation(spec, model.state_dict(), perms))
    result = activation_matching(spec, model, other, _ids(32), batch_size=16)
    assert _is_identity(compose_permutations(perms, result.perms))
    assert result.objectives[1] > result.objectives[0]


def test_the_tied_lm_head_follows_the_token_embedding():
    model = _model("gpt2-lm")
    hf = model.model
    assert hf.lm_head.weight is hf.get_input_embeddings().weight
    spec = transformer_spec(model)
    keys = spec.keys()
    assert "model.transformer.wte.weight" in keys and not any("lm_head" in key for key in keys)
    assert not any("lm_head" in key for key in model.state_dict())
    permuted = apply_permutation(spec, model.state_dict(), random_permutation(spec, 3))
    model.load_state_dict(permuted)  # fills lm_head from the permuted wte: still tied
    assert hf.lm_head.weight is hf.get_input_embeddings().weight
    assert torch.equal(hf.lm_head.weight, permuted["model.transformer.wte.weight"])


def test_a_wrong_spec_is_caught_and_a_bare_encoder_keeps_its_output_basis():
    model = _model("gpt2")
    spec = transformer_spec(model)
    heads = spec.groups["layer_0.heads"]
    without_output_columns = type(heads)(heads.size, heads.axes[:2], heads.probe)  # c_proj left out
    with pytest.raises(ValueError, match="changes the model's outputs"):
        verify_transformer_spec(model, PermutationSpec({**spec.groups, "layer_0.heads": without_output_columns}))
    assert PermutationSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    bare = _model("bert").model.bert  # BertModel: its output is the residual stream itself
    assert "residual" not in transformer_spec(bare).groups
    assert "residual" in transformer_spec(_model("bert")).groups


def test_conv1d_grams_are_permuted_on_their_input_axis():
    model = _model("gpt2")
    spec = transformer_spec(model)
    perms = random_permutation(spec, 2)
    ids = _ids(8)
    grams = linear_input_grams(model, ids)
    key = CONV1D + "model.transformer.h.0.mlp.c_proj.weight"
    assert key in grams
    other = _model("gpt2")
    other.load_state_dict(apply_permutation(spec, model.state_dict(), perms))
    expected = linear_input_grams(other, ids)
    for name, gram in permute_grams(spec, grams, perms).items():
        torch.testing.assert_close(gram, expected[name], rtol=1e-4, atol=1e-5)


def test_only_bert_and_gpt2_have_specs_and_others_are_refused():
    assert set(SPEC_BUILDERS) == set(ALIGNABLE_MODEL_TYPES)
    assert all(callable(imported(family.permutation_spec)) for family in DECLARED.values() if family.aligns)
    from transformers import RobertaConfig, RobertaForSequenceClassification

    config = RobertaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=16, max_position_embeddings=20)  # fmt: skip
    with pytest.raises(ValueError, match="no permutation spec for transformers model_type 'roberta'"):
        transformer_spec(RobertaForSequenceClassification(config))
