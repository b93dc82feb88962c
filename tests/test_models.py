from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from mergeflow.models import build_from_spec, count_parameters
from mergeflow.models.sequential import ARCHITECTURES, build_model, model_spec

DIGITS_SHAPE = (1, 8, 8)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_output_shape_and_plain_sequential(arch: str) -> None:
    model = build_model(arch, DIGITS_SHAPE, 10, seed=1)
    assert type(model) is nn.Sequential
    out = model(torch.zeros(5, *DIGITS_SHAPE))
    assert out.shape == (5, 10)
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in model.parameters())


def test_mlp_layers_follow_widths_and_activation() -> None:
    model = build_model("mlp", [4], 1, widths=[8, 6], activation="tanh")
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(4, 8), (8, 6), (6, 1)]
    assert sum(isinstance(m, nn.Tanh) for m in model) == 2


def test_linear_is_single_layer() -> None:
    model = build_model("linear", [3, 2], 4)
    assert count_parameters(model) == 6 * 4 + 4


def test_cnn_parameter_count_near_24k_on_digits() -> None:
    n = count_parameters(build_model("cnn", DIGITS_SHAPE, 10))
    assert abs(n - 24_000) <= 0.15 * 24_000


def test_same_seed_identical_and_different_seed_different() -> None:
    for arch in ARCHITECTURES:
        a = _weights(build_model(arch, DIGITS_SHAPE, 10, seed=7))
        b = _weights(build_model(arch, DIGITS_SHAPE, 10, seed=7))
        c = _weights(build_model(arch, DIGITS_SHAPE, 10, seed=8))
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert not any(torch.equal(x, z) for x, z in zip(a, c, strict=True))


def test_init_does_not_touch_global_rng() -> None:
    state = torch.get_rng_state()
    build_model("cnn", DIGITS_SHAPE, 10, seed=3)
    assert torch.equal(state, torch.get_rng_state())


def test_spec_round_trips_through_json() -> None:
    spec = model_spec("mlp", (64,), 10, widths=(32, 16), activation="tanh", seed=5)
    loaded = json.loads(json.dumps(spec))
    assert loaded == spec
    assert set(spec) >= {"arch", "input_shape", "output_dim", "widths", "activation", "channels", "seed"}
    rebuilt = build_from_spec(loaded)
    original = build_model("mlp", (64,), 10, widths=(32, 16), activation="tanh", seed=5)
    assert str(rebuilt) == str(original)
    assert all(torch.equal(x, y) for x, y in zip(_weights(rebuilt), _weights(original), strict=True))


def test_spec_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="depth"):
        model_spec("mlp", (4,), 2, depth=3)


def test_cnn_on_flat_input_raises() -> None:
    with pytest.raises(ValueError, match="model.arch"):
        build_model("cnn", [64], 10)


def test_unknown_arch_and_activation_raise() -> None:
    with pytest.raises(ValueError, match="model.arch"):
        build_model("transformer", [4], 2)
    with pytest.raises(ValueError, match="activation"):
        build_model("mlp", [4], 2, activation="gelu")
