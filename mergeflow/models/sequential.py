"""Linear, MLP and small CNN models as plain ``nn.Sequential``.

Every model is a plain :class:`torch.nn.Sequential` so that alignment code can
walk its Linear/Conv2d chain and MLflow can reload it.  Weights are initialised
from an explicit :class:`torch.Generator` (never the global RNG), so the same
seed yields bit-identical weights in any thread.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mergeflow.models.family import ModelFamily

ARCHITECTURES = ("linear", "mlp", "cnn")
ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}

# A hidden width of 36 gives 23,648 parameters on digits (1x8x8, 10 classes).
DEFAULT_CNN_HIDDEN = 36

# Keyword arguments of build_model recorded in a spec, with their defaults.
_SPEC_DEFAULTS: dict[str, Any] = {
    "widths": (64,),
    "activation": "relu",
    "channels": (16, 32),
    "cnn_hidden": DEFAULT_CNN_HIDDEN,
    "seed": 0,
}


def build_model(
    arch: str,
    input_shape: list[int] | tuple[int, ...],
    output_dim: int,
    *,
    widths: list[int] | tuple[int, ...] = (64,),
    activation: str = "relu",
    channels: list[int] | tuple[int, ...] = (16, 32),
    cnn_hidden: int = DEFAULT_CNN_HIDDEN,
    seed: int = 0,
) -> nn.Sequential:
    """Build a deterministically initialised model.

    Args:
        arch: one of :data:`ARCHITECTURES`.
        input_shape: shape of one example, e.g. ``[64]`` or ``[1, 8, 8]``.
        output_dim: number of classes (logits) or 1 for regression.
        widths: hidden layer widths of the MLP.
        activation: MLP activation, ``"relu"`` or ``"tanh"``.
        channels: output channels of the CNN's 3x3 convolutions; the
            convolutions are followed by one 2x2 max-pool.
        cnn_hidden: width of the CNN's hidden fully connected layer.
        seed: seed of the generator used to initialise all weights.

    Returns:
        A plain ``nn.Sequential`` on the CPU.

    Raises:
        ValueError: on an unknown ``model.arch``/activation, or a CNN whose
            input shape is not ``(C, H, W)``.
    """
    shape = [int(d) for d in input_shape]
    if arch == "linear":
        layers = [nn.Flatten(), _linear(math.prod(shape), output_dim)]
    elif arch == "mlp":
        layers = _mlp_layers(math.prod(shape), output_dim, widths, activation)
    elif arch == "cnn":
        layers = _cnn_layers(shape, output_dim, channels, cnn_hidden)
    else:
        raise ValueError(f"unknown model.arch {arch!r}; expected one of {ARCHITECTURES}")
    model = nn.Sequential(*layers).to_empty(device="cpu")
    _init_weights(model, seed)
    return model


def _linear(n_in: int, n_out: int) -> nn.Linear:
    # Built on the meta device: no memory, no use of the global RNG.
    return nn.Linear(n_in, n_out, device="meta")


def _mlp_layers(n_in: int, output_dim: int, widths: list[int] | tuple[int, ...], activation: str) -> list[nn.Module]:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown model.activation {activation!r}; expected one of {tuple(ACTIVATIONS)}")
    layers: list[nn.Module] = [nn.Flatten()]
    for width in widths:
        layers += [_linear(n_in, int(width)), ACTIVATIONS[activation]()]
        n_in = int(width)
    layers.append(_linear(n_in, output_dim))
    return layers


def _cnn_layers(
    shape: list[int], output_dim: int, channels: list[int] | tuple[int, ...], hidden: int
) -> list[nn.Module]:
    if len(shape) != 3:
        raise ValueError(f"model.arch 'cnn' needs input_shape (C, H, W), got {shape}")
    n_in, height, width = shape
    layers: list[nn.Module] = []
    for n_out in channels:
        layers += [nn.Conv2d(n_in, int(n_out), 3, padding=1, device="meta"), nn.ReLU()]
        n_in = int(n_out)
    layers += [
        nn.MaxPool2d(2),
        nn.Flatten(),
        _linear(n_in * (height // 2) * (width // 2), hidden),
        nn.ReLU(),
        _linear(hidden, output_dim),
    ]
    return layers


@torch.no_grad()
def _init_weights(model: nn.Module, seed: int) -> None:
    """PyTorch's default init distribution, U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    drawn from a private generator in module order."""
    gen = torch.Generator().manual_seed(int(seed))
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            fan_in = module.weight[0].numel()
            bound = 1.0 / math.sqrt(fan_in)
            module.weight.uniform_(-bound, bound, generator=gen)
            if module.bias is not None:
                module.bias.uniform_(-bound, bound, generator=gen)


def model_spec(
    arch: str,
    input_shape: list[int] | tuple[int, ...],
    output_dim: int,
    **kwargs: Any,
) -> dict[str, Any]:
    """Return a JSON-serialisable spec from which :func:`build_from_spec`
    rebuilds the same architecture (and initial weights).

    ``kwargs`` are the keyword arguments of :func:`build_model`; omitted ones
    take its defaults, so the spec is always complete.
    """
    unknown = set(kwargs) - set(_SPEC_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown model spec keys: {sorted(unknown)}")
    options = {**_SPEC_DEFAULTS, **kwargs}
    return {
        "arch": str(arch),
        "input_shape": [int(d) for d in input_shape],
        "output_dim": int(output_dim),
        "widths": [int(w) for w in options["widths"]],
        "activation": str(options["activation"]),
        "channels": [int(c) for c in options["channels"]],
        "cnn_hidden": int(options["cnn_hidden"]),
        "seed": int(options["seed"]),
    }


def build_sequential_from_spec(spec: dict[str, Any]) -> nn.Sequential:
    """Build the model described by a :func:`model_spec` dict."""
    options = {key: spec[key] for key in _SPEC_DEFAULTS if key in spec}
    return build_model(spec["arch"], spec["input_shape"], spec["output_dim"], **options)


def head_names(model: nn.Module) -> tuple[str, ...]:
    """The state-dict keys of ``model``'s head: its last ``nn.Linear`` layer's weight and bias."""
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not linears:
        raise ValueError("the model has no Linear layer, so no head")
    name, module = linears[-1]
    return tuple(f"{name}.{key}" if name else key for key, _ in module.named_parameters())


class SequentialFamily(ModelFamily):
    """Linear, MLP and CNN models as plain ``nn.Sequential`` (``model.arch``: linear, mlp, cnn)."""

    def build_base(
        self, model: dict[str, Any], info: dict[str, Any], output_dim: int, seed: int
    ) -> tuple[nn.Module, dict[str, Any]]:
        options = {"widths": model["widths"], "activation": model["activation"], "seed": seed}
        spec = model_spec(model["arch"], info["input_shape"], output_dim, **options)
        return build_sequential_from_spec(spec), spec

    def from_spec(self, spec: dict[str, Any]) -> nn.Module:
        return build_sequential_from_spec(spec)

    def head_names(self, spec: dict[str, Any]) -> tuple[str, ...]:
        return head_names(build_sequential_from_spec(spec))

    def with_outputs(self, spec: dict[str, Any], output_dim: int, seed: int | None = None) -> dict[str, Any]:
        return spec | {"output_dim": int(output_dim)} | ({} if seed is None else {"seed": int(seed)})
