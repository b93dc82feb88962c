"""Federated rounds with local heads (``federated.heads``): FedPer's ``local`` and FedBABU's ``frozen``.

The server aggregates the body only, each client keeps its own head across rounds, frozen heads move only in
the final fine-tuning, the pipeline's steps give the plain loop's numbers, and the default plans today's steps.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mergeflow.checkpoints import load_checkpoint, save_checkpoint
from mergeflow.config import Params, validate_params
from mergeflow.errors import ConfigError
from mergeflow.federated import ClientData, LocalHeads, LocalTraining, get_algorithm, model_parameters, run_rounds
from mergeflow.federated.base import MEAN, client_generator, load_parameters
from mergeflow.federated.heads import HEAD
from mergeflow.federated.local import local_train
from mergeflow.federated.rounds import client_step, server_step
from mergeflow.federated.server_plan import ServerPlan
from mergeflow.heads import head_names
from mergeflow.models.sequential import build_sequential_from_spec, model_spec

SPEC = model_spec("mlp", [4], 3, widths=[5], seed=1)
TRAIN = LocalTraining(epochs=1, lr=0.1, batch_size=8)
_generator = torch.Generator().manual_seed(0)
CLIENTS = [
    ClientData(torch.randn(n, 4, generator=_generator), torch.randint(0, 3, (n,), generator=_generator))
    for n in (20, 12, 16)
]
SIZES = {k: len(data) for k, data in enumerate(CLIENTS)}
TEST = ClientData(torch.randn(30, 4, generator=_generator), torch.randint(0, 3, (30,), generator=_generator))


def _build() -> torch.nn.Module:
    return build_sequential_from_spec(SPEC)


def _heads(mode: str, epochs: int = 1) -> LocalHeads:
    return LocalHeads(mode, head_names(SPEC), epochs)


def _run(algorithm: str, heads: LocalHeads | None, rounds: int = 2, **kwargs) -> object:
    return run_rounds(algorithm, _build, CLIENTS, rounds, train=TRAIN, eval_data=TEST, heads=heads, **kwargs)


def _one_round(algorithm: str, heads: LocalHeads, plan: ServerPlan | None = None):
    """Round 1 on the real client and server steps: the messages and the new server state."""
    algo = get_algorithm(algorithm)
    options = algo.parse_options(None)
    base = heads.prepare(_build())
    initial, head = model_parameters(base), heads.head_of(base)
    server = algo.init_server(initial, len(CLIENTS), options)
    sent = {}
    for k, data in enumerate(CLIENTS):
        state = heads.with_head(algo.init_client(initial, options), head)
        message, _, metrics = client_step(algo, _build(), server, state, data, TRAIN, options, 0, 1, k, plan, heads)
        sent[k] = (message, metrics)
    new, _ = server_step(algo, server, sent, SIZES, len(CLIENTS), options, "fail", 1, plan)
    return initial, {k: message for k, (message, _) in sent.items()}, new


def test_the_head_names_are_the_last_linear_layer():
    assert head_names(SPEC) == ("3.weight", "3.bias")


@pytest.mark.parametrize("mode", ["local", "frozen"])
def test_the_server_averages_the_bodies_of_the_messages(mode):
    body, messages, server = _one_round("fedavg", _heads(mode))
    assert set(body) == {"1.weight", "1.bias"}
    assert all(set(message) == {MEAN + name for name in body} for message in messages.values())
    total = sum(SIZES.values())
    for name in body:
        expected = sum(SIZES[k] / total * messages[k][MEAN + name] for k in messages)
        assert torch.equal(server[MEAN + name], expected), name
    assert not any(key.endswith(("3.weight", "3.bias")) for key in server)


def test_a_robust_aggregator_acts_on_the_bodies():
    plan = ServerPlan.build(len(CLIENTS), 1, 1.0, 0, aggregator="median")
    body, messages, server = _one_round("fedavg", _heads("local"), plan)
    for name in body:
        stacked = torch.stack([messages[k][MEAN + name] for k in sorted(messages)])
        assert torch.equal(server[MEAN + name], stacked.median(dim=0).values), name


def test_fedper_heads_are_each_clients_own_training_never_averaged():
    heads = _heads("local")
    first, second = _run("fedavg", heads, rounds=1), _run("fedavg", heads, rounds=2)
    body = get_algorithm("fedavg").global_state(first.server)
    own = []
    for k, data in enumerate(CLIENTS):
        model = _build()  # round 2 by hand: the global body, the client's own head, the whole model trained
        load_parameters(model, body | {name[len(HEAD) :]: t for name, t in first.client_states[k].items()})
        local_train(model, data, TRAIN, client_generator(0, 1, k))
        trained = dict(model.named_parameters())
        for name in heads.names:
            kept = second.client_states[k][HEAD + name]
            assert torch.equal(kept, trained[name].detach().double()), (k, name)
        own.append(second.client_states[k][HEAD + "3.weight"])
    assert not torch.equal(own[0], own[1]) and not torch.equal(own[1], own[2])
    # the model scored: the global body with the clients' example-weighted average head
    total = sum(SIZES.values())
    average = sum(SIZES[k] / total * second.client_states[k][HEAD + "3.bias"] for k in SIZES)
    assert torch.allclose(second.global_state["3.bias"], average, rtol=0, atol=1e-15)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedadmm", "bayes_admm"])
def test_fedbabu_heads_stay_at_their_initialisation_until_the_final_fine_tuning(algorithm):
    options = {"rho": 1.0} if algorithm == "bayes_admm" else None
    initial = _heads("frozen").head_of(_build())
    untuned = _run(algorithm, _heads("frozen", epochs=0), rounds=3, options=options)
    tuned = _run(algorithm, _heads("frozen", epochs=1), rounds=3, options=options)
    for k in SIZES:
        for name, value in initial.items():
            assert torch.equal(untuned.client_states[k][HEAD + name], value), (k, name)
            assert not torch.equal(tuned.client_states[k][HEAD + name], value), (k, name)
    body = get_algorithm(algorithm).global_state(tuned.server)
    assert not torch.equal(body["1.weight"], _build()[1].weight.double())  # the body was trained
    # the rounds before the last are the same; only the last one's heads are fine-tuned
    assert [row["accuracy"] for row in tuned.metrics[:-1]] == [row["accuracy"] for row in untuned.metrics[:-1]]
    for k, data in enumerate(CLIENTS):
        model = _build()  # the fine-tuning by hand: the final body frozen, the initial head trained
        load_parameters(model, body | initial)
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name in initial)
        local_train(model, data, TRAIN, client_generator(0, 3, k))
        for name, parameter in model.named_parameters():
            if name in initial:
                assert torch.equal(tuned.client_states[k][HEAD + name], parameter.detach().double()), (k, name)


# ----------------------------------------------------------------------------- params


def _raw(**federated) -> dict:
    return {"federated": {"algorithms": ["fedavg"], **federated}}


def _multitask(**federated) -> dict:
    tasks = {
        "low": {"data": {"source": "digits"}, "labels": {0: 0, 1: 1, 2: 2}},
        "high": {"data": {"source": "digits"}, "labels": {7: 0, 8: 1, 9: 2}},
    }
    return _raw(**federated) | {"tasks": tasks}


def _problem(raw: dict) -> str:
    with pytest.raises(ConfigError) as error:
        validate_params(raw)
    return error.value.lines[0]


def test_the_heads_rules():
    assert validate_params(_raw(heads="local")).federated.heads_of(False) == "local"
    assert validate_params(_multitask()).federated.heads_of(True) == "local"
    validate_params(_raw(heads="frozen", algorithms=["bayes_admm"]))
    assert "federated.heads" in _problem(_raw(heads="local", algorithms=["fedavg", "bayes_admm"]))
    assert "use frozen" in _problem(_raw(heads="local", algorithms=["bayes_admm"]))
    assert "federated.heads: shared" in _problem(_multitask(heads="shared"))


def _step_params(params: Params) -> list[tuple[str, dict]]:
    from tasks.federated import plan_federated

    return [(step.name, step.params) for wave in plan_federated(params) for step in wave]


def test_a_single_task_run_plans_todays_steps_by_default():
    raw = _raw(algorithms=["fedavg", "fedadmm"], rounds=2, fraction=0.67)
    default = _step_params(validate_params(raw))
    assert default == _step_params(validate_params(_raw(**raw["federated"], heads="auto", head_epochs=1)))
    assert default == _step_params(validate_params(_raw(**raw["federated"], heads="shared", head_epochs=3)))
    new_keys = {"heads", "head_rounds", "head_finetuning", "head_epochs", "tasks", "task", "poisoned"}
    assert all(not new_keys & set(step_params) for _, step_params in default)
    assert not any(name.endswith("/heads") for name, _ in default)
    frozen = _step_params(validate_params(_raw(**raw["federated"], heads="frozen")))
    assert [name for name, _ in frozen] == [name for name, _ in default][:-1] + [
        "federated/fedavg/heads",
        "federated/fedadmm/heads",
        "federated/summary",
    ]


# ----------------------------------------------------------------------------- the flow


def _write_table(path, data: ClientData) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"x": data.X.tolist(), "y": data.y.tolist()}), path)


def _workspace(root) -> None:
    """The files the federated stage reads: the base model, the test split, the partitions and their sizes."""
    from tasks.layout import BASE, PARTITION_METRICS, PARTITIONS, PREPARED, client_file

    model = _build()
    save_checkpoint(root / BASE, model.state_dict(), {"spec": SPEC})
    info = {"task": "classification", "input_shape": [4], "num_classes": 3}
    for directory in (PREPARED, PARTITIONS):
        (root / directory).mkdir(parents=True, exist_ok=True)
        (root / directory / "info.json").write_text(json.dumps(info))
    _write_table(root / PREPARED / "test.parquet", TEST)
    for k, data in enumerate(CLIENTS):
        _write_table(root / client_file(k), data)
    (root / PARTITION_METRICS).parent.mkdir(parents=True, exist_ok=True)
    (root / PARTITION_METRICS).write_text(json.dumps({"sizes": [len(data) for data in CLIENTS]}))


@pytest.mark.parametrize(
    ("mode", "attack"),
    [("local", None), ("frozen", None), ("frozen", {"clients": 1, "kind": "label_flip"})],
    ids=["local", "frozen", "frozen-label-flip"],
)
def test_the_flow_steps_give_the_plain_loops_numbers(tmp_path, mode, attack):
    from tasks.federated import loop_inputs, plan_federated
    from tasks.layout import global_checkpoint
    from tasks.steps import resolve

    federated = {
        "algorithms": ["fedavg", "fedadmm"],
        "rounds": 2,
        "fraction": 0.67,
        "heads": mode,
        "predictive_samples": 0,
        "local": {"epochs": 1, "lr": 0.1, "batch_size": 8, "momentum": 0.0},
        "attack": attack,
    }
    params = validate_params({"partition": {"num_clients": 3}, "federated": federated})
    _workspace(tmp_path)
    for wave in plan_federated(params):
        for step in wave:
            resolve(step.fn)(step.params, tmp_path, tmp_path, step.settings)
    curves = json.loads((tmp_path / "metrics/federated.json").read_text())
    builder, clients, test = loop_inputs(tmp_path, 3)
    heads = LocalHeads(mode, head_names(SPEC))
    for name in federated["algorithms"]:
        train = LocalTraining(**params.federated.local_for(name).model_dump())
        run = run_rounds(
            name, builder, clients, 2, train=train, fraction=0.67, eval_data=test, heads=heads, attack=attack
        )
        assert [row["accuracy"] for row in curves[name]] == [row["accuracy"] for row in run.metrics]
        assert [row["nll"] for row in curves[name]] == [row["nll"] for row in run.metrics]
        assert [row.get("drift") for row in curves[name][1:]] == [row["drift"] for row in run.metrics[1:]]
        final, meta = load_checkpoint(tmp_path / global_checkpoint(name, 2))
        assert meta["round"] == 2 and set(final) == set(run.global_state)
        for key, value in final.items():
            assert torch.equal(value, run.global_state[key].to(value.dtype)), key


def _task_workspace(root, params: Params) -> dict[str, dict]:
    """A multi-task run's files: each task's base (the shared body, its own head), test split and partitions'
    description; the clients' partitions by global id. Returns each task's spec."""
    from tasks.layout import PARTITION_METRICS, TaskPaths, client_file

    body = _build().state_dict()
    specs = {}
    for task, classes in (("low", 3), ("high", 2)):
        paths, spec = TaskPaths(task), model_spec("mlp", [4], classes, widths=[5], seed=len(task))
        state = build_sequential_from_spec(spec).state_dict()
        save_checkpoint(
            root / paths.base, {**state, "1.weight": body["1.weight"], "1.bias": body["1.bias"]}, {"spec": spec}
        )
        info = {"task": "classification", "input_shape": [4], "num_classes": classes}
        for path in (f"{paths.prepared}/info.json", paths.partitions_info):
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(json.dumps(info))
        _write_table(root / paths.prepared / "test.parquet", ClientData(TEST.X, TEST.y % classes))
        specs[task] = spec
    for ref in params.clients:
        classes = specs[ref.task]["output_dim"]
        _write_table(root / client_file(ref.index), ClientData(CLIENTS[ref.index].X, CLIENTS[ref.index].y % classes))
    (root / PARTITION_METRICS).parent.mkdir(parents=True, exist_ok=True)
    (root / PARTITION_METRICS).write_text(json.dumps({"sizes": [len(data) for data in CLIENTS]}))
    return specs


@pytest.mark.parametrize("mode", ["auto", "frozen"])
def test_a_multitask_run_keeps_each_tasks_head(tmp_path, mode):
    from safetensors.torch import load_file

    from tasks.federated import plan_federated
    from tasks.layout import TaskPaths, client_state_file, round_metrics_file, server_file
    from tasks.steps import resolve

    raw = _multitask(heads=mode, rounds=2, predictive_samples=0, local={"epochs": 1, "batch_size": 8})
    raw["tasks"]["low"]["clients"] = 2
    params = validate_params(raw)
    assert [(ref.index, ref.task) for ref in params.clients] == [(0, "low"), (1, "low"), (2, "high")]
    _task_workspace(tmp_path, params)
    steps = [step for wave in plan_federated(params) for step in wave]
    assert next(s for s in steps if s.name == "federated/fedavg/r001/client_002").params["task"] == "high"
    for step in steps:
        resolve(step.fn)(step.params, tmp_path, tmp_path, step.settings)
    server = load_file(tmp_path / server_file("fedavg", 2))
    final = {
        task: load_checkpoint(tmp_path / TaskPaths(task).global_checkpoint("fedavg", 2))[0] for task in ("low", "high")
    }
    for task in final:
        for name in ("1.weight", "1.bias"):  # the global body, the same in every task's model
            assert torch.equal(final[task][name], server[MEAN + name].float()), (task, name)
    assert final["low"]["3.weight"].shape == (3, 5) and final["high"]["3.weight"].shape == (2, 5)
    if mode == "auto":  # FedPer: a one-client task's head is its client's, bit for bit
        state = load_checkpoint(tmp_path / client_state_file("fedavg", 2, 2))[0]
        for name in ("3.weight", "3.bias"):
            assert torch.equal(final["high"][name], state[HEAD + name].float()), name
    row = json.loads((tmp_path / round_metrics_file("fedavg", 2)).read_text())
    accuracies = [row["tasks"][task]["accuracy"] for task in ("low", "high")]
    assert row["accuracy"] == pytest.approx(sum(accuracies) / 2)


@pytest.mark.slow
def test_fedbabu_through_the_cli_and_a_new_head_epochs_reruns_only_the_heads_steps(tmp_path, cli_env):
    from conftest import fast_params, make_workspace, ran_steps, run_cli

    federated = {"algorithms": ["fedavg", "fedadmm"], "rounds": 2, "heads": "frozen"}
    workspace = make_workspace(tmp_path, fast_params(merge={"methods": ["average"]}, federated=federated))
    done = run_cli(["run"], workspace, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {"federated/fedavg/heads", "federated/fedadmm/heads"} <= ran_steps(workspace)
    curves = json.loads((workspace / "metrics/federated.json").read_text())
    metrics = json.loads((workspace / "metrics/evaluate.json").read_text())
    for name in federated["algorithms"]:
        assert metrics[f"federated/{name}"]["accuracy"] == curves[name][-1]["accuracy"]

    done = run_cli(["run", "-S", "federated.head_epochs=2"], workspace, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = {"federated/fedavg/heads", "federated/fedadmm/heads", "federated/summary", "evaluate", "track"}
    assert ran_steps(workspace) == expected
