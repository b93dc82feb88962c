"""LoRA adapters extracted from a merged transformer reproduce it: exactly at full rank, to the truncation below."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

from mergeflow.adapters import AdapterRankError, extract_lora

IDS = torch.tensor([[1, 5, 7, 9, 2, 3], [4, 4, 8, 1, 0, 6]])


def _bert() -> BertForSequenceClassification:
    config = BertConfig(
        vocab_size=30,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=8,
        num_labels=3,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config).eval()


def _gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=30, n_embd=16, n_layer=2, n_head=2, n_positions=8, attn_implementation="eager")
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def _perturbed(model: torch.nn.Module, rank: int | None = None) -> dict[str, torch.Tensor]:
    """The model's state with every parameter moved; 2-D weights by a rank-``rank`` update when given."""
    generator = torch.Generator().manual_seed(1)
    state = {}
    for name, value in model.named_parameters():
        if rank is not None and value.dim() == 2:
            left = torch.randn(value.shape[0], rank, generator=generator)
            right = torch.randn(rank, value.shape[1], generator=generator)
            state[name] = value.detach() + 0.05 * left @ right
        else:
            state[name] = value.detach() + 0.05 * torch.randn(value.shape, generator=generator)
    return state


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _reloaded(make, adapter, tmp_path) -> torch.nn.Module:
    """The adapter as a user loads it: saved, then put on a freshly built base."""
    adapter.model.save_pretrained(tmp_path)
    return PeftModel.from_pretrained(make(), tmp_path).eval()


@pytest.mark.parametrize("make", [_bert, _gpt2], ids=["bert", "gpt2"])
def test_a_full_rank_adapter_reproduces_the_merged_logits(make, tmp_path):
    base, merged_state = make(), _perturbed(make())
    merged = make()
    merged.load_state_dict(merged_state, strict=False)
    adapter = extract_lora(base, merged_state, rank=min(base.config.hidden_size, 16))
    assert max(adapter.errors.values()) < 1e-12  # float64 SVD at full rank
    reloaded = _reloaded(make, adapter, tmp_path)
    torch.testing.assert_close(_logits(reloaded), _logits(merged), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(_logits(base), _logits(merged), atol=1e-3)  # the base alone is not the merge
    if make is _gpt2:  # Conv1D projections take the LoRA; the tied embedding and its head are stored whole
        assert any(name.endswith("attn.c_attn") for name in adapter.ranks) and "transformer.wte" in adapter.saved


def test_a_low_rank_update_is_found_at_its_rank_and_truncation_is_the_eckart_young_error(tmp_path):
    base, merged_state = _bert(), _perturbed(_bert(), rank=2)
    merged = _bert()
    merged.load_state_dict(merged_state, strict=False)
    exact = extract_lora(base, merged_state, energy=0.999999)
    assert set(exact.ranks.values()) == {2} and max(exact.errors.values()) < 1e-6  # the float32 rounding of W + ΔW
    torch.testing.assert_close(_logits(_reloaded(_bert, exact, tmp_path)), _logits(merged), atol=1e-5, rtol=1e-5)

    truncated = extract_lora(base, merged_state, rank=1)
    name = "bert.encoder.layer.0.attention.self.query"
    delta = merged_state[f"{name}.weight"].double() - base.get_submodule(name).weight.detach().double()
    singular = torch.linalg.svdvals(delta)
    expected = float(singular[1:].norm() / singular.norm())
    assert truncated.errors[name] == pytest.approx(expected, rel=1e-9)
    layer = truncated.model.base_model.model.get_submodule(name)
    product = layer.lora_B["default"].weight.detach().double() @ layer.lora_A["default"].weight.detach().double()
    assert torch.linalg.matrix_rank(product) == 1


def test_a_rank_beyond_a_module_is_refused():
    base = _bert()
    with pytest.raises(AdapterRankError, match="larger than module"):
        extract_lora(base, _perturbed(_bert()), rank=17)
