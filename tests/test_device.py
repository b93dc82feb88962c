"""Tensors made on the wrong device, caught on the CPU.

Under ``torch.device("meta")`` every factory call that names no device makes a meta tensor; with the
inputs on the CPU, the first op that mixes it with them fails ("not on the expected device"), as it
would on CUDA. Code that makes its tensors on its data's device passes.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from device_cases import merge_cases, merge_inputs, strict_devices, tiny_classifier, tiny_data

from mergeflow.align.barrier import loss_barrier, make_loss_fn, make_metric_fn
from mergeflow.align.matching import align_models
from mergeflow.align.trace import permutation_spec
from mergeflow.config import validate_params
from mergeflow.device import device_problem
from mergeflow.errors import ConfigError
from mergeflow.federated import ALGORITHMS, ClientData, LocalTraining
from mergeflow.federated.loop import run_rounds
from mergeflow.fisher import diagonal_fisher, fisher_factors, fisher_sketch
from mergeflow.grams import linear_input_grams
from mergeflow.merge import run_merge
from mergeflow.preflight import check_model
from mergeflow.training import predict, train


@pytest.mark.parametrize("method", merge_cases())
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


def test_a_training_step_and_prediction_make_their_tensors_on_the_models_device():
    model, (X, y) = tiny_classifier(), tiny_data()
    before = [p.detach().clone() for p in model.parameters()]
    with strict_devices():
        result = train(model, X, y, task="classification", epochs=1, lr=0.1, batch_size=8, optimizer="adam")
        outputs = predict(model, X, task="classification")
    assert len(result.losses) == 3 and outputs.shape == (24, 3)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("backend", ["functorch", "backpack"])
@pytest.mark.parametrize("kind", ["empirical", "sampled", "exact"])
def test_fisher_paths_make_their_tensors_on_the_models_device(kind, backend):
    model, (X, y) = tiny_classifier(), tiny_data()
    options = {"kind": kind, "task": "classification", "backend": backend, "batch_size": 10}
    with strict_devices():
        diagonal = diagonal_fisher(model, X, y, **options)
        factors = fisher_factors(model, X, y, **options)
        sketch, _ = fisher_sketch(model, X, y, rows=4, **options)
        grams = linear_input_grams(model, X, batch_size=10)
    assert {t.device.type for t in [*diagonal.values(), factors, sketch, *grams.values()]} == {"cpu"}


def test_grams_move_host_rows_to_the_models_device():
    """Rows given on the host go where the model is (a model on ``meta`` stands in for a GPU here)."""
    model, (X, _) = tiny_classifier().to("meta"), tiny_data()
    with strict_devices():
        grams = linear_input_grams(model, X, batch_size=10)
    assert grams and {t.device.type for t in grams.values()} == {"meta"}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_a_federated_round_makes_its_tensors_on_the_models_device(algorithm):
    if algorithm == "bayes_admm":
        pytest.importorskip("ivon")
    X, y = tiny_data(rows=32)
    clients = [ClientData(torch.as_tensor(X[i::2]), torch.as_tensor(y[i::2])) for i in range(2)]
    template = tiny_classifier()  # built outside: a builder makes its model on the CPU
    with strict_devices():
        run = run_rounds(
            algorithm, lambda: copy.deepcopy(template), clients, 1, train=LocalTraining(epochs=1, batch_size=8)
        )
    assert len(run.metrics) == 2 and math.isfinite(run.metrics[-1]["train_loss"])
    tensors = [*run.global_state.values(), *run.server.values()]
    assert tensors and {t.device.type for t in tensors} == {"cpu"}


SERVER_PLANS = {
    "gaussian attack, krum": {"attack": {"clients": 1, "kind": "gaussian", "scale": 1.0}, "aggregator": "krum"},
    "sign flip, median": {"attack": {"clients": 1, "kind": "sign_flip", "scale": 1.0}, "aggregator": "median"},
    "label flip, adam": {"attack": {"clients": 1, "kind": "label_flip"}, "server": {"optimizer": "adam"}},
    "dp, adaptive clip": {"dp": {"clip": 1.0, "noise_multiplier": 0.2, "adaptive": True}, "fraction": 0.5},
}


@pytest.mark.parametrize("plan", sorted(SERVER_PLANS))
def test_attacks_robust_rules_server_optimizers_and_dp_make_their_tensors_on_the_models_device(plan):
    X, y = tiny_data(rows=48)
    clients = [ClientData(torch.as_tensor(X[i::6]), torch.as_tensor(y[i::6])) for i in range(6)]
    template = tiny_classifier()
    with strict_devices():
        run = run_rounds(
            "fedavg",
            lambda: copy.deepcopy(template),
            clients,
            2,
            train=LocalTraining(epochs=1, batch_size=8),
            **SERVER_PLANS[plan],
        )
    assert {t.device.type for t in run.global_state.values()} == {"cpu"}


@pytest.mark.parametrize("method", ["weights", "activations"])
def test_alignment_and_barriers_make_their_tensors_on_the_models_device(method):
    model, (X, y) = tiny_classifier(), tiny_data()
    spec = permutation_spec(model, [4])
    reference, other = tiny_classifier(1).state_dict(), tiny_classifier(2).state_dict()
    with strict_devices():
        ((aligned, perms),) = align_models(spec, reference, [other], method=method, inputs=X, model=model)
        result = loss_barrier(
            make_loss_fn(model, X, y), reference, aligned, n_points=3, metric_fn=make_metric_fn(model, X, y)
        )
    assert {t.device.type for t in [*aligned.values(), *perms.values()]} == {"cpu"}
    assert len(result.losses) == 3 and math.isfinite(result.barrier)


def test_mixed_precision_autocasts_the_forward_pass_and_keeps_float32_weights():
    X, y = tiny_data(rows=32)
    runs = {}
    for precision in ("fp32", "bf16", "fp16"):
        model = tiny_classifier()
        runs[precision] = train(model, X, y, task="classification", epochs=1, lr=0.1, batch_size=8, precision=precision)
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert runs["bf16"].losses != runs["fp32"].losses  # autocast ran the forward pass in bf16
    np.testing.assert_allclose(runs["bf16"].losses, runs["fp32"].losses, rtol=0.02)
    np.testing.assert_allclose(runs["fp16"].losses, runs["fp32"].losses, rtol=0.02)
