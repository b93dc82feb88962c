"""The GPU suite (``make gpu-check``, ``pytest -m gpu``): every merge method, the Fisher paths, alignment,
training, federated rounds and the pipeline's stages on CUDA against the CPU, within stated tolerances.

Skipped without CUDA. ``MERGEFLOW_TEST_DEVICE=cpu`` runs it against the CPU itself (a check of the suite,
where everything must agree exactly). Imports only the library and what it needs (torch, numpy, scipy,
pydantic, safetensors, transformers/peft for transformers): no Prefect, DVC or MLflow, so it runs on a bare
GPU machine. Federated rounds need ``ivon-opt``, the stage run ``matplotlib``, BackPACK its package: each
test that needs one is skipped without it.

Tolerances (relative to the CPU's result, float32 weights): merges 1e-5 (their float64 sums differ only in
reduction order); Fisher statistics and Grams 1e-4; a training step, prediction and a federated round 1e-4;
the whole pipeline's test accuracies within 0.03 (epochs of float32 training drift apart by rounding).
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from device_cases import DEVICE_DRAWS, merge_cases, merge_inputs, tiny_classifier, tiny_data

from mergeflow.merge import METHODS, merge, run_merge
from mergeflow.schema.merge import DECLARED

DEVICE = torch.device(os.environ.get("MERGEFLOW_TEST_DEVICE", "cuda"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _close(device_value, cpu_value, rtol: float, atol: float = 1e-7) -> None:
    torch.testing.assert_close(torch.as_tensor(device_value).cpu(), torch.as_tensor(cpu_value), rtol=rtol, atol=atol)


def _states_close(on_device: dict, on_cpu: dict, rtol: float, atol: float = 1e-7) -> None:
    assert on_device.keys() == on_cpu.keys()
    for name, value in on_device.items():
        assert value.device.type == DEVICE.type, name
        _close(value.to(on_cpu[name].dtype), on_cpu[name], rtol, atol)


def test_the_device_is_named():
    from mergeflow.device import device_name

    print(f"\ndevice under test: {DEVICE} ({device_name(DEVICE)}), torch {torch.__version__}")


@pytest.mark.parametrize("method", merge_cases())
def test_every_merge_method_on_the_device_matches_the_cpu(method):
    on_cpu = run_merge(method, **merge_inputs(method, "cpu"))
    on_device = run_merge(method, **merge_inputs(method, DEVICE))
    if method in DEVICE_DRAWS:  # the device's own draws: the same seed gives the same merge there
        again = run_merge(method, **merge_inputs(method, DEVICE))
        assert all(torch.equal(on_device.state[k], again.state[k]) for k in on_device.state)
        assert set(on_device.state) == set(on_cpu.state)
        return
    _states_close(on_device.state, on_cpu.state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("whole_split", [True, False])
def test_a_training_step_trains_on_the_device_and_matches_the_cpu(whole_split, monkeypatch):
    import mergeflow.device
    from mergeflow.training import predict, train

    if not whole_split:  # the data stay on the CPU and go a batch at a time (pinned, non-blocking)
        monkeypatch.setattr(mergeflow.device, "RESIDENT_BYTES", 0)
    X, y = tiny_data(rows=64)
    cpu_model, device_model = tiny_classifier(), tiny_classifier().to(DEVICE)
    cpu = train(cpu_model, X, y, task="classification", epochs=3, lr=0.1, batch_size=16)
    gpu = train(device_model, X, y, task="classification", epochs=3, lr=0.1, batch_size=16)
    assert gpu.epoch_losses[-1] < gpu.epoch_losses[0]  # it trains
    _close(gpu.losses, cpu.losses, rtol=1e-4)
    _states_close(device_model.state_dict(), cpu_model.state_dict(), rtol=1e-4, atol=1e-6)
    _close(predict(device_model, X), predict(cpu_model, X), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_and_keeps_float32_weights(precision):
    from mergeflow.device import device_problem
    from mergeflow.training import train

    if DEVICE.type != "cuda" or device_problem(str(DEVICE), precision):
        pytest.skip(f"{precision} autocast is checked on a GPU that supports it")
    X, y = tiny_data(rows=64)
    model = tiny_classifier().to(DEVICE)
    result = train(model, X, y, task="classification", epochs=5, lr=0.1, batch_size=16, precision=precision)
    assert result.epoch_losses[-1] < result.epoch_losses[0]
    assert {p.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize("backend", ["functorch", "backpack"])
@pytest.mark.parametrize("kind", ["empirical", "sampled", "exact"])
def test_fisher_paths_on_the_device_match_the_cpu(kind, backend):
    from mergeflow.fisher import diagonal_fisher, fisher_factors, fisher_sketch
    from mergeflow.grams import linear_input_grams

    if backend == "backpack":
        pytest.importorskip("backpack")
    X, y = tiny_data(rows=40)
    options = {"kind": kind, "task": "classification", "backend": backend, "batch_size": 16}
    cpu_model, device_model = tiny_classifier(), tiny_classifier().to(DEVICE)
    _states_close(diagonal_fisher(device_model, X, y, **options), diagonal_fisher(cpu_model, X, y, **options), 1e-4)
    _close(fisher_factors(device_model, X, y, **options), fisher_factors(cpu_model, X, y, **options), 1e-4, 1e-6)
    sketch, facts = fisher_sketch(device_model, X, y, rows=8, **options)
    cpu_sketch, cpu_facts = fisher_sketch(cpu_model, X, y, rows=8, **options)
    _close(sketch.T @ sketch, cpu_sketch.T @ cpu_sketch, 1e-4, 1e-6)  # the sketch's rows have a sign freedom
    assert math.isclose(facts["trace"], cpu_facts["trace"], rel_tol=1e-4)
    _states_close(linear_input_grams(device_model, X), linear_input_grams(cpu_model, X), 1e-4)


@pytest.mark.parametrize("method", ["weights", "activations"])
def test_alignment_and_barriers_on_the_device_match_the_cpu(method):
    from mergeflow.align.barrier import loss_barrier, make_loss_fn
    from mergeflow.align.matching import align_models
    from mergeflow.align.trace import permutation_spec

    X, y = tiny_data(rows=64)
    results = {}
    for device in ("cpu", DEVICE):
        model = tiny_classifier().to(device)
        spec = permutation_spec(model, [4])
        reference = {k: v.to(device) for k, v in tiny_classifier(1).state_dict().items()}
        other = {k: v.to(device) for k, v in tiny_classifier(2).state_dict().items()}
        ((aligned, perms),) = align_models(spec, reference, [other], method=method, inputs=X, model=model)
        barrier = loss_barrier(make_loss_fn(model, X, y), reference, aligned, n_points=5)
        results[str(device)] = (aligned, perms, barrier.losses)
    (aligned, perms, losses), (cpu_aligned, cpu_perms, cpu_losses) = results[str(DEVICE)], results["cpu"]
    assert all(torch.equal(perms[k].cpu(), cpu_perms[k]) for k in perms)
    _states_close(aligned, cpu_aligned, 0, 0)  # a permutation moves values, it computes none
    _close(losses, cpu_losses, 1e-4)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "fedadmm", "bayes_admm"])
def test_a_federated_round_on_the_device_matches_the_cpu(algorithm):
    pytest.importorskip("ivon")
    from mergeflow.federated import ClientData, LocalTraining
    from mergeflow.federated.loop import run_rounds

    X, y = tiny_data(rows=64)
    clients = [ClientData(torch.as_tensor(X[i::2]), torch.as_tensor(y[i::2])) for i in range(2)]
    local = LocalTraining(epochs=1, batch_size=16)
    runs = {}
    for device in ("cpu", DEVICE):
        template = tiny_classifier().to(device)
        runs[str(device)] = run_rounds(algorithm, lambda t=template: copy.deepcopy(t), clients, 2, train=local)
    gpu, cpu = runs[str(DEVICE)], runs["cpu"]
    _states_close(gpu.global_state, cpu.global_state, rtol=1e-4, atol=1e-6)
    assert math.isclose(gpu.metrics[-1]["train_loss"], cpu.metrics[-1]["train_loss"], rel_tol=1e-4)


def _run_stages(params, root: Path) -> dict:
    """Every stage's steps in order, called directly (no Prefect; MLflow tracking left out), writing
    into ``root``; the evaluation's metrics."""
    from tasks.layout import METRICS
    from tasks.stages import STAGES
    from tasks.steps import resolve

    for stage in STAGES:
        for phase in stage.phases:
            planned = resolve(phase)(params)
            waves = planned if planned and isinstance(planned[0], list) else [planned]
            for wave in waves:
                for step in wave:
                    if not step.fn.startswith("tasks.tracking"):
                        resolve(step.fn)(step.params, root, root, step.settings)
    return json.loads((root / METRICS).read_text())


def test_every_stage_runs_on_the_device_and_scores_as_the_cpu(tmp_path):
    pytest.importorskip("ivon")
    pytest.importorskip("matplotlib")
    from conftest import pipeline_params

    from mergeflow.config import validate_params

    raw = pipeline_params()
    raw["partition"] |= {"num_clients": 3}
    raw["pretrain"] |= {"epochs": 3}
    raw["finetune"] |= {"epochs": 2}
    raw["federated"] |= {"rounds": 2}
    raw["merge"]["options"]["ssf"] |= {"steps": 20}
    scores = []
    for run, device in enumerate(("cpu", str(DEVICE))):
        raw["orchestration"]["device"] = device
        root = tmp_path / f"run{run}"
        root.mkdir()
        scores.append(_run_stages(validate_params(raw), root))
    cpu, gpu = scores
    compared = [name for name, value in cpu.items() if isinstance(value, dict) and "accuracy" in value]
    assert {"base", "centralized"} <= set(compared) and any(name.startswith("merged/") for name in compared)
    for name in compared:
        assert abs(gpu[name]["accuracy"] - cpu[name]["accuracy"]) <= 0.03, (name, gpu[name], cpu[name])
    print(
        "\n" + "\n".join(f"{n:<28} cpu {cpu[n]['accuracy']:.4f}  {DEVICE} {gpu[n]['accuracy']:.4f}" for n in compared)
    )


@pytest.mark.parametrize("lora", [False, True])
def test_a_transformer_trains_and_its_fisher_runs_on_the_device_as_on_the_cpu(lora):
    """A 1-layer BERT (no dropout), full or LoRA fine-tuning, then its diagonal Fisher: within 1e-3 of the CPU's."""
    from mergeflow.fisher import diagonal_fisher
    from mergeflow.models.lora import lora as with_lora
    from mergeflow.training import train

    template, ids, labels = _tiny_bert()
    settings = {"r": 2, "alpha": 4.0, "dropout": 0.0, "target_modules": ["query", "value"]}
    results = []
    for device in ("cpu", DEVICE):
        model = copy.deepcopy(template).to(device)
        options = {"task": "classification", "epochs": 2, "lr": 1e-3, "optimizer": "adam", "batch_size": 8}
        if lora:
            with torch.random.fork_rng(devices=[]), with_lora(model, settings, seed=0):
                run = train(model, ids, labels, **options)
        else:
            run = train(model, ids, labels, **options)
        fisher = diagonal_fisher(model, ids, labels, kind="empirical", backend="functorch", batch_size=8)
        results.append((run.losses, model.state_dict(), fisher))
    (cpu_losses, cpu_state, cpu_fisher), (losses, state, fisher) = results
    _close(losses, cpu_losses, 1e-3)
    _states_close({k: v for k, v in state.items() if v.is_floating_point()},
                  {k: v for k, v in cpu_state.items() if v.is_floating_point()}, 1e-3, 1e-5)  # fmt: skip
    _states_close(fisher, cpu_fisher, 1e-3, 1e-9)


@pytest.mark.parametrize(
    "method", sorted(name for name, declaration in METHODS.items() if declaration.scope == "tensor")
)
def test_every_streamed_merge_on_the_device_matches_the_cpu(method, tmp_path, monkeypatch):
    """``merge_files(device=...)``: blocks read on the host, merged on the device, with several blocks per
    tensor (and masks drawn from whole task vectors) as a GPT-2 checkpoint has at ``DEVICE_BLOCK``."""
    from safetensors.torch import load_file, save_file

    from mergeflow.merge import streaming

    monkeypatch.setattr(streaming, "DEVICE_BLOCK", 1000)
    generator = torch.Generator().manual_seed(0)

    def write(name: str, positive: bool = False) -> Path:
        shapes = {"layer.weight": (64, 48), "layer.bias": (64,), "head.weight": (5, 64)}
        state = {k: torch.rand(s, generator=generator) if positive else torch.randn(s, generator=generator)
                 for k, s in shapes.items()}  # fmt: skip
        save_file(state | ({} if positive else {"steps": torch.tensor([3])}), str(tmp_path / name))
        return tmp_path / name

    count = 2 if DECLARED[method].model_count_problem(3) else 3  # slerp merges exactly two
    inputs = {"paths": [write(f"model_{k}.safetensors") for k in range(count)], "weights": [1.0, 2.0, 4.0][:count]}
    if "base" in METHODS[method].needs | METHODS[method].uses:
        inputs["base"] = write("base.safetensors")
    if "fishers" in METHODS[method].needs:
        inputs["fishers"] = [write(f"fisher_{k}.safetensors", positive=True) for k in range(count)]
    merged = {}
    for device in ("cpu", DEVICE, DEVICE):
        out = tmp_path / f"merged_{len(merged)}.safetensors"
        streaming.merge_files(method, out=out, device=device, **inputs)
        merged[len(merged)] = load_file(str(out))
    cpu, on_device, again = merged[0], merged[1], merged[2]
    assert all(torch.equal(on_device[k], again[k]) for k in cpu)  # the same seed, the same merge there

    def read(paths: list[Path]) -> list[dict[str, torch.Tensor]]:
        return [load_file(str(path), device=str(DEVICE)) for path in paths]

    in_memory = merge(  # the same draws and arithmetic as the whole tensors on the device, block by block
        method,
        read(inputs["paths"]),
        base=read([inputs["base"]])[0] if "base" in inputs else None,
        weights=inputs["weights"],
        fishers=read(inputs["fishers"]) if "fishers" in inputs else None,
    )
    _states_close(in_memory, on_device, rtol=1e-6, atol=1e-7)
    if method not in DEVICE_DRAWS:
        for name in cpu:
            _close(on_device[name], cpu[name], rtol=1e-5, atol=1e-6)


def _tiny_bert() -> tuple[torch.nn.Module, np.ndarray, np.ndarray]:
    """A 1-layer BERT classifier without dropout (seeded), and 32 padded texts of token ids with labels."""
    from transformers import BertConfig, BertForSequenceClassification

    from mergeflow.models.token_model import TokenModel

    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=12,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    template = TokenModel(BertForSequenceClassification(config), pad_token_id=0)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 50, (32, 12))
    ids[:, 9:] = 0
    return template, ids, rng.integers(0, 3, 32)


@pytest.mark.parametrize("arch", ["mlp", "bert"])
def test_the_same_seed_trains_the_same_weights_on_the_device_unless_torch_warns(arch):
    """The README's reproducibility promise on a GPU: with ``use_deterministic`` (what every pipeline step
    asks for), two trainings from the same seed give bit-identical weights, unless torch warned of an op
    without a deterministic kernel. An MLP has none, so it must repeat exactly."""
    import warnings

    from mergeflow.device import use_deterministic
    from mergeflow.training import train

    use_deterministic(DEVICE)
    template, X, y = (tiny_classifier(), *tiny_data(rows=64)) if arch == "mlp" else _tiny_bert()
    states = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model = copy.deepcopy(template).to(DEVICE)
            train(model, X, y, task="classification", epochs=2, lr=1e-3, optimizer="adam", batch_size=8, seed=3)
            states.append(model.state_dict())
    same = all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    warned = sorted({str(w.message)[:90] for w in caught if "determinis" in str(w.message)})
    print(f"\n{arch} on {DEVICE}: {'bit-identical' if same else 'differs'}; torch warned: {warned or 'nothing'}")
    assert same or (arch != "mlp" and warned)


def _task_models(device) -> dict:
    """Two tasks' models (3 and 2 classes) with one body, as a multi-task run's base makes them."""
    from device_cases import tiny_classifier

    from mergeflow.heads import task_base
    from mergeflow.models import build_from_spec
    from mergeflow.models.sequential import model_spec

    spec = model_spec("mlp", [4], 3, widths=[5], seed=0)
    base = tiny_classifier().state_dict()
    models = {}
    for k, (task, classes) in enumerate((("three", 3), ("two", 2))):
        task_spec, state = task_base(spec, base, classes, seed=10 + k)
        models[task] = build_from_spec(task_spec)
        models[task].load_state_dict(state)
        models[task].to(device)
    return models


def test_joint_multi_task_training_on_the_device_matches_the_cpu():
    from mergeflow.heads import head_names
    from mergeflow.multitask import train_jointly

    X, y = tiny_data(rows=96)
    data = {"three": (X[:64], y[:64]), "two": (X[64:], y[64:] % 2)}
    runs = []
    for device in ("cpu", DEVICE, DEVICE):
        models = _task_models(device)
        result = train_jointly(
            models, data, heads=head_names(_spec()), task="classification", epochs=2, lr=0.1, batch_size=16, seed=1
        )
        runs.append(({task: model.state_dict() for task, model in models.items()}, result.losses))
    cpu, first, again = runs
    assert first[1] == again[1]  # the device's run is deterministic
    for task in cpu[0]:
        _states_close(first[0][task], cpu[0][task], rtol=1e-4, atol=1e-6)


def _spec() -> dict:
    from mergeflow.models.sequential import model_spec

    return model_spec("mlp", [4], 3, widths=[5], seed=0)


@pytest.mark.parametrize("method", ["average", "task_arithmetic", "ties", "fisher", "regmean"])
def test_a_merge_of_tasks_with_their_own_heads_on_the_device_matches_the_cpu(method):
    from mergeflow.fisher import diagonal_fisher
    from mergeflow.grams import linear_input_grams
    from mergeflow.heads import head_names
    from mergeflow.merge.tasks import merge_tasks

    X, y = tiny_data(rows=48)
    merged = {}
    for device in ("cpu", DEVICE):
        models = _task_models(device)
        base = {k: v.clone() for k, v in models["three"].state_dict().items()}
        for k, model in enumerate(models.values()):  # each client a little away from the base
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(0.01 * (k + 1) * torch.ones_like(parameter))
        labels = {"three": y, "two": y % 2}
        fishers = [diagonal_fisher(m, X, labels[t], kind="exact", task="classification") for t, m in models.items()]
        grams = [linear_input_grams(m, X) for m in models.values()]
        states = [m.state_dict() for m in models.values()]
        tasks, _ = merge_tasks(
            method, states, list(models), head_names(_spec()), base=base, weights=[30, 18], fishers=fishers, grams=grams
        )
        merged[str(device)] = (tasks, states)
    (cpu, _), (on_device, clients) = merged["cpu"], merged[str(DEVICE)]
    for k, task in enumerate(cpu):
        _states_close(on_device[task], cpu[task], rtol=1e-5, atol=1e-7)
        for name in head_names(_spec()):  # each task keeps its own client's head, bit for bit
            assert torch.equal(on_device[task][name], clients[k][name])


def test_a_federated_round_with_local_heads_on_the_device_matches_the_cpu():
    pytest.importorskip("ivon")
    from mergeflow.federated import ClientData, LocalTraining
    from mergeflow.federated.heads import LocalHeads
    from mergeflow.federated.loop import run_rounds
    from mergeflow.heads import head_names

    X, y = tiny_data(rows=64)
    clients = [ClientData(torch.as_tensor(X[i::2]), torch.as_tensor(y[i::2])) for i in range(2)]
    heads = LocalHeads("local", head_names(_spec()), 1)
    runs = {}
    for device in ("cpu", DEVICE):
        template = tiny_classifier().to(device)
        model = lambda t=template: copy.deepcopy(t)  # noqa: E731
        runs[str(device)] = run_rounds(
            "fedavg", model, clients, 2, train=LocalTraining(epochs=1, batch_size=16), heads=heads
        )
    gpu, cpu = runs[str(DEVICE)], runs["cpu"]
    _states_close(gpu.global_state, cpu.global_state, rtol=1e-4, atol=1e-6)
