"""Small inputs for every compute path, on a chosen device: the CPU suite runs them under a ``meta``
default device (``tests/test_device.py``), the GPU suite on CUDA against the CPU (``tests/gpu``).

Imports only the library and torch, so the GPU suite runs where Prefect, DVC and MLflow are absent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from mergeflow.merge import METHODS
from mergeflow.models.sequential import build_model

# Methods that draw from a generator on their inputs' device (fast on a GPU, reproducible per kind of
# device): their CUDA draws differ from the CPU's, so the GPU suite checks them for reproducibility.
DEVICE_DRAWS = frozenset({"dare_linear", "dare_ties", "della", "della_linear"})


def _state(generator: torch.Generator, device: torch.device | str) -> dict[str, torch.Tensor]:
    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float64).to(device, torch.float32)

    return {
        "fc.weight": draw(3, 4),
        "fc.bias": draw(3),
        "out.weight": draw(2, 3),
        "steps": torch.tensor(7, device=device),  # a non-floating buffer: taken from the first model
    }


def merge_inputs(method: str, device: torch.device | str = "cpu", clients: int = 2) -> dict[str, Any]:
    """Keyword arguments of ``run_merge(method, ...)``: the clients' states and every input the method
    needs or uses (base, sizes, Fishers, factors, Grams, a scorer), on ``device``."""
    generator = torch.Generator().manual_seed(0)
    declaration = METHODS[method]
    wanted = declaration.needs | declaration.uses
    states = [_state(generator, device) for _ in range(clients)]
    floating = [name for name, value in states[0].items() if value.is_floating_point()]
    width = sum(states[0][name].numel() for name in floating)

    def positive(like: torch.Tensor) -> torch.Tensor:
        return torch.rand(like.shape, generator=generator, dtype=torch.float64).to(device, like.dtype) + 0.1

    inputs: dict[str, Any] = {"states": states, "weights": [3.0, 5.0, 2.0][:clients]}
    if "base" in wanted:
        inputs["base"] = _state(generator, device)
    if "fishers" in wanted:
        inputs["fishers"] = [{name: positive(state[name]) for name in floating} for state in states]
    if "factors" in wanted:
        inputs["factors"] = [
            torch.randn((2, width), generator=generator, dtype=torch.float64).to(device, torch.float32) for _ in states
        ]
    if "grams" in wanted:
        grams = []
        for _ in states:
            rows = torch.randn((6, 4), generator=generator, dtype=torch.float64).to(device)
            grams.append({"fc.weight": rows.T @ rows})
        inputs["grams"] = grams
    if "scorer" in wanted:
        inputs["scorer"] = lambda state: -float(state["fc.weight"].double().square().sum())
    return inputs | few_steps(method)


def few_steps(method: str) -> dict[str, int]:
    """Options that cut an iterative method short (a test checks devices, not convergence)."""
    fields = METHODS[method].Options.model_fields
    return {name: 3 for name in ("steps", "max_iter", "iterations") if name in fields}


def merge_cases() -> list[str]:
    """Every registered merge method (new ones are covered as they register)."""
    return sorted(METHODS)


def tiny_classifier(seed: int = 0) -> nn.Module:
    """A 4-input, 3-class MLP."""
    return build_model("mlp", [4], 3, widths=[5], seed=seed)


def tiny_data(rows: int = 24, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Features and class labels for :func:`tiny_classifier`."""
    generator = np.random.default_rng(seed)
    return generator.normal(size=(rows, 4)).astype(np.float32), generator.integers(0, 3, rows)


class _MixedDevices(TorchFunctionMode):
    """Fails any torch call whose tensor arguments lie on more than one device (copies excepted): the
    ops a CUDA run would refuse, and those the meta device lets through (masks, where, indexing)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _COPIES:
            leaves, _ = tree_flatten((args, kwargs))
            devices = {leaf.device for leaf in leaves if isinstance(leaf, torch.Tensor)}
            if len(devices) > 1:
                raise RuntimeError(f"{getattr(func, '__name__', func)} mixes tensors on {sorted(map(str, devices))}")
        return func(*args, **kwargs)


_COPIES = {torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.type_as}


@contextmanager
def strict_devices() -> Iterator[None]:
    """Run code over CPU inputs so that a tensor made without its data's device fails: factory calls that
    name no device make meta tensors, and any op over tensors on different devices raises."""
    with torch.device("meta"), _MixedDevices():
        yield
