"""Tensors made on the wrong device, caught on the CPU.

Under ``torch.device("meta")`` every factory call that names no device makes a meta tensor; with the
inputs on the CPU, the first op that mixes it with them fails ("not on the expected device"), as it
would on CUDA. Code that makes its tensors on its data's device passes.
"""

from __future__ import annotations

import pytest
import torch
from device_cases import SPARSE, merge_cases, merge_inputs, strict_devices

from mergeflow.config import validate_params
from mergeflow.device import device_problem
from mergeflow.errors import ConfigError
from mergeflow.merge import run_merge
from mergeflow.preflight import check_model

SPARSE_MARK = pytest.mark.xfail(strict=False, reason="fixed on the sparse branch")


def _cases(names: list[str]) -> list:
    return [pytest.param(name, marks=SPARSE_MARK) if name in SPARSE else name for name in names]


@pytest.mark.parametrize("method", _cases(merge_cases()))
def test_every_merge_method_makes_its_tensors_on_its_inputs_device(method):
    inputs = merge_inputs(method)
    with strict_devices():
        result = run_merge(method, **inputs)
    assert {tensor.device.type for tensor in result.state.values()} == {"cpu"}
    assert set(result.state) == set(inputs["states"][0])


def _one_gpu_without_bf16(monkeypatch) -> None:
    """torch told it sees one CUDA device, a card without bf16 (a V100)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "Tesla V100-SXM2-16GB")


@pytest.mark.parametrize(
    ("device", "precision", "gpu", "needle"),
    [
        ("cuda", "fp32", False, "orchestration.device: 'cuda' needs CUDA"),
        ("cuda:3", "fp32", True, "orchestration.device: 'cuda:3': this machine has 1 CUDA device(s)"),
        ("cuda", "bf16", True, "finetune.precision: bf16 is not supported by Tesla V100"),
        ("auto", "bf16", True, "finetune.precision: bf16 is not supported by Tesla V100"),
    ],
)
def test_a_device_or_precision_the_machine_lacks_is_one_line_naming_the_key(
    monkeypatch, device, precision, gpu, needle
):
    if gpu:
        _one_gpu_without_bf16(monkeypatch)
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    params = validate_params({"orchestration": {"device": device}, "finetune": {"precision": precision}})
    with pytest.raises(ConfigError) as caught:
        check_model(params, "params.yaml")
    (line,) = caught.value.lines
    assert line.startswith(f"params.yaml: {needle}")
    assert device_problem("cpu") is None and device_problem("auto") is None
