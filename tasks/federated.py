"""Steps of the ``federated`` stage: rounds of cached client updates, each followed by a server update.

The stage plans waves of steps, run one after another: an init wave (every algorithm's
round-0 server and client states), then for each round one wave with a client step per
participant of every algorithm and one wave with each algorithm's server step, then a
summary. Every step is keyed by the content of the files it reads (the previous server
state, the client's last state, its data), so a killed run resumes at the last finished
step, and changing one algorithm's options re-runs only that algorithm's rounds.

Participation is sampled from the seed when planning, so a client's state input is the
file written the last round it took part in. The steps call exactly what
``mergeflow.federated.run_rounds`` calls, with the same generators, so the flow reproduces
the plain loop bit for bit (a single-task run's; the loop runs one task).

Clients that keep their own heads (``federated.heads``: local, frozen) keep them in their state files; a
server step then also reads every client's latest state, for the heads of the models it writes and scores
(one per task: the global body with the task's clients' average head). Under ``frozen`` a last step per
algorithm, ``federated/<name>/heads``, fine-tunes every client's head on the final body and writes the last
round's models in place of the last server step.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mergeflow.checkpoints import load_checkpoint, load_checkpoint_meta, save_checkpoint
from mergeflow.config import Params, federated_heads
from mergeflow.config.tasks_section import ClientRef
from mergeflow.data.encode import target_scale
from mergeflow.errors import MergeflowError
from mergeflow.federated import (
    ClientData,
    LocalTraining,
    get_algorithm,
    load_parameters,
    model_parameters,
)
from mergeflow.federated.heads import LocalHeads, clients_head
from mergeflow.federated.loop import global_scores
from mergeflow.federated.rounds import client_step, head_step, round_schedule, server_step
from mergeflow.federated.server_plan import ServerPlan, attackers
from mergeflow.files import atomic_path, write_json
from mergeflow.heads import head_names
from mergeflow.models import build_from_spec
from mergeflow.objectives import get_objective
from mergeflow.plots import plot_rounds
from mergeflow.schema.federated import ALGORITHMS, ATTACKS, Attack, server_step_members
from mergeflow.seeding import derive_seed
from mergeflow.training import DivergenceError
from tasks.layout import (
    FEDERATED_INDEX,
    FEDERATED_METRICS,
    FEDERATED_PLOT,
    PARTITION_METRICS,
    TaskPaths,
    client_file,
    client_state_file,
    message_file,
    round_metrics_file,
    server_file,
)
from tasks.prepared import read_arrays, read_info
from tasks.step_devices import device_settings, on_cpu, step_device
from tasks.steps import Step

_METRICS_KEY = "mergeflow.metrics"
_ROW_KEY = "mergeflow.row"  # a server state's header: its round's row, when the heads step writes the round's models


def read_message(path: Path, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A client's message file: its tensors (on ``device``) and its metrics."""
    with safe_open(str(path), framework="pt", device=device) as f:
        metrics = json.loads((f.metadata() or {}).get(_METRICS_KEY, "{}"))
        return {key: f.get_tensor(key) for key in f.keys()}, metrics


def _save_message(path: Path, message: dict[str, torch.Tensor], metrics: dict[str, Any]) -> None:
    # One file, not a tensor file and a metrics file: a new file costs most of a short client update's I/O.
    _save(path, message, {_METRICS_KEY: json.dumps(metrics, sort_keys=True)})


def _settings(params: Params, name: str) -> dict[str, Any]:
    algorithm, options = params.federated.resolve(name)
    return (
        {
            "name": name,
            "algorithm": algorithm,
            "options": options.model_dump(mode="json", exclude_unset=True),
            "local": params.federated.local_for(name).model_dump(mode="json"),
            "num_clients": params.num_clients,
            "seed": params.seed,
            "noise_std": params.evaluate.noise_std,
        }
        | _exchange(params)
        | _heads_settings(params)
    )


def _heads_settings(params: Params) -> dict[str, Any]:
    """How the clients keep their heads, when they do (nothing for a shared head, so that plain runs keep
    their cache keys)."""
    heads = federated_heads(params)
    return {} if heads == "shared" else {"heads": heads}


def _task_settings(params: Params) -> dict[str, Any]:
    """A multi-task run's clients by task (nothing in a single-task run, whose clients are all one task's)."""
    if not params.multitask:
        return {}
    tasks: dict[str, list[int]] = {}
    for ref in params.clients:
        tasks.setdefault(ref.task, []).append(ref.index)
    return {"tasks": tasks}


def _task_clients(params: dict[str, Any]) -> dict[str | None, list[int]]:
    """A step's clients by task (:func:`_task_settings`): every client in the single task None without tasks."""
    return params.get("tasks") or {None: list(range(params["num_clients"]))}


def _heads(root: Path, params: dict[str, Any], task: str | None) -> LocalHeads | None:
    """How a step's clients of ``task`` keep their heads (the head's names from the task's base model), or None
    for a shared head."""
    if "heads" not in params:
        return None
    spec = load_checkpoint_meta(root / TaskPaths(task).base)["spec"]
    return LocalHeads(params["heads"], head_names(spec), params.get("head_epochs", 1))


def _exchange(params: Params) -> dict[str, Any]:
    """The adapters clients exchange under ``federated.exchange: adapters`` (nothing for full models)."""
    if params.federated.exchange != "adapters":
        return {}
    return {"adapters": params.section("finetune.lora")}


def federated_model(root: Path, params: dict[str, Any], task: str | None = None) -> torch.nn.Module:
    """The model a federated step trains and scores: the architecture of ``task``'s base model (its parameters
    come from the server state and the client's head), or with exchanged adapters the base model itself,
    frozen, with LoRA adapters."""
    base = root / TaskPaths(task).base
    if not params.get("adapters"):
        return build_from_spec(load_checkpoint_meta(base)["spec"])
    from mergeflow.models.lora import attach_adapters

    base_state, base_meta = load_checkpoint(base)
    model = build_from_spec(base_meta["spec"])
    model.load_state_dict(base_state)
    return attach_adapters(model, params["adapters"], derive_seed(params["seed"], "federated", "adapters"))


def _global_weights(
    root: Path, params: dict[str, Any], state: dict[str, torch.Tensor], task: str | None = None
) -> dict[str, torch.Tensor]:
    """The global model's full weights: the server's parameters (and the task's head), or the base model with
    the global adapters folded in."""
    if not params.get("adapters"):
        base_state = load_checkpoint(root / TaskPaths(task).base)[0]
        return {k: v.to(base_state[k].dtype) for k, v in state.items()}
    from mergeflow.models.lora import fold_adapters

    model = load_parameters(federated_model(root, params), state)
    return fold_adapters(model).state_dict()


def _server_settings(params: Params, name: str) -> dict[str, Any]:
    """What the server step of entry ``name`` does beyond the algorithm's own step (nothing by default,
    so that plain runs keep their cache keys): its server optimizer, aggregator, attack and DP."""
    federated = params.federated
    server, aggregator = federated.server_for(name), federated.aggregator_for(name)
    plan = {}
    if not server.is_identity:
        plan["server"] = server.model_dump(mode="json")
    if not aggregator.is_identity:
        plan["aggregator"] = aggregator.model_dump(mode="json")
    if federated.attack is not None and federated.attack.clients > 0:
        plan["attack"] = federated.attack.model_dump(mode="json")
    if federated.dp is not None:
        plan["dp"] = federated.dp.model_dump(mode="json")
    if not plan:
        return {}
    # The run's length changes a round's result only through a noise calibrated to a target ε.
    calibrated = federated.dp is not None and federated.dp.target_epsilon is not None
    return {
        "server_plan": plan | {"fraction": federated.fraction} | ({"rounds": federated.rounds} if calibrated else {})
    }


def _server_plan(params: dict[str, Any], num_classes: int | None = None) -> ServerPlan | None:
    """The :class:`ServerPlan` of a step's ``server_plan`` settings (None without them)."""
    plan = params.get("server_plan")
    if plan is None:
        return None
    return ServerPlan.build(
        params["num_clients"],
        plan.get("rounds", params["round"]),  # unread unless the noise is calibrated to a target ε
        plan["fraction"],
        params["seed"],
        server=plan.get("server"),
        aggregator=plan.get("aggregator"),
        attack=plan.get("attack"),
        dp=plan.get("dp"),
        num_classes=num_classes,
    )


def _data_attack(params: Params, client: int) -> Attack | None:
    """The data attack that client ``client`` trains under (a data-poisoning attacker's), or None."""
    attack = params.federated.attack
    if attack is None or not attack.poisons_data:
        return None
    return attack.declaration if client in attackers(params.num_clients, attack, params.seed) else None


def _members(params: Params, name: str) -> tuple[str, ...]:
    """The module of entry ``name``'s algorithm, which its steps run (:attr:`tasks.steps.Step.members`), and
    those of the run's model family and objective, which build and score its models."""
    return (ALGORITHMS.lookup(params.federated.algorithm_of(name)).module, *params.model_members)


def _server_members(params: Params, name: str) -> tuple[str, ...]:
    """The modules entry ``name``'s server step runs: its algorithm's, and those of the server optimizer,
    aggregator and attack it runs around the algorithm's own step."""
    federated = params.federated
    around = server_step_members(federated.server_for(name), federated.aggregator_for(name), federated.attack)
    return _members(params, name) + tuple(member.module for member in around)


def _evaluation_settings(params: Params) -> dict[str, Any]:
    """What only the init and server steps read: client updates do not depend on these."""
    return {
        "predictive_samples": params.federated.predictive_samples,
        "on_divergence": params.federated.on_divergence,
        "validation": params.data.validation_fraction > 0,
    }


def _evaluation_inputs(params: Params) -> tuple[str, ...]:
    """What scoring the models reads: each task's base model, test split and description (and validation)."""
    inputs: tuple[str, ...] = ()
    for task in params.task_names:
        paths = TaskPaths(task)
        inputs += (paths.base, f"{paths.prepared}/test.parquet", f"{paths.prepared}/info.json")
        if params.data.validation_fraction > 0:
            inputs += (f"{paths.prepared}/validation.parquet",)
    return inputs


def _client_inputs(client: ClientRef) -> tuple[str, ...]:
    """What a client's training reads beside the states: its task's base model, its partition and their
    description."""
    paths = TaskPaths(client.task)
    return paths.base, client_file(client.index), paths.partitions_info


def _task_of(client: ClientRef) -> dict[str, Any]:
    """A client step's task, in a multi-task run (nothing in a single-task one, whose step params stay as they are)."""
    return {} if client.task is None else {"task": client.task}


def plan_federated(params: Params) -> list[list[Step]]:
    """Waves: init, then (clients, server) per round, then (clients keeping frozen heads) the heads' fine-tuning,
    then the summary."""
    names = params.federated.algorithms
    evaluation = _evaluation_inputs(params)
    tasks = _task_settings(params)
    waves = [
        [
            Step(
                f"federated/{name}/init",
                "tasks.federated:init_rounds",
                {**_settings(params, name), **_evaluation_settings(params), **tasks},
                evaluation,
                settings=device_settings(params),
                members=_members(params, name),
            )
            for name in names
        ]
    ]
    federated = params.federated
    heads = federated_heads(params)
    poisson = federated.dp is not None
    schedule = round_schedule(params.num_clients, federated.rounds, federated.fraction, params.seed, poisson=poisson)
    latest = [0] * params.num_clients  # the round each client's state was last written in
    refs = params.clients  # built anew by each call: once here, not per client step
    for step in schedule:
        r, clients, servers = step.number, [], []
        taking_part = set(step.participants)
        latest = [r if k in taking_part else last for k, last in enumerate(latest)]
        for name in names:
            settings = _settings(params, name)
            for k in step.participants:
                base, partition, info = _client_inputs(refs[k])
                inputs = (
                    base,
                    server_file(name, r - 1),
                    client_state_file(name, step.state_rounds[k], k),
                    partition,
                    info,
                )
                step_params = {
                    **settings,
                    **_task_of(refs[k]),
                    "round": r,
                    "client": k,
                    "state_round": step.state_rounds[k],
                }
                members = _members(params, name)
                if poison := _data_attack(params, k):
                    step_params, members = step_params | {"attack": poison.name}, members + (poison.module,)
                clients.append(
                    Step(
                        f"federated/{name}/r{r:03d}/client_{k:03d}",
                        "tasks.federated:client_round",
                        step_params,
                        inputs,
                        settings=device_settings(params),
                        members=members,
                    )
                )
            messages = tuple(message_file(name, r, k) for k in step.participants)
            heads_params: dict[str, Any] = {}
            states: tuple[str, ...] = ()
            if heads != "shared":  # every client's latest state: the heads of this round's models
                heads_params = {"head_rounds": latest}
                if heads == "frozen" and r == federated.rounds:  # the heads step writes this round's models
                    heads_params["head_finetuning"] = True
                states = tuple(client_state_file(name, last, k) for k, last in enumerate(latest))
            servers.append(
                Step(
                    f"federated/{name}/r{r:03d}/server",
                    "tasks.federated:server_round",
                    {
                        **settings,
                        **_evaluation_settings(params),
                        **_server_settings(params, name),
                        **tasks,
                        **heads_params,
                        "round": r,
                        "participants": step.participants,
                    },
                    (*evaluation, server_file(name, r - 1), PARTITION_METRICS, *messages, *states),
                    settings=device_settings(params),
                    members=_server_members(params, name),
                )
            )
        waves += [clients, servers]
    if heads == "frozen":
        waves.append([_heads_step(params, name, latest) for name in names])
    metrics = tuple(round_metrics_file(name, r) for name in names for r in range(params.federated.rounds + 1))
    settings = {
        name: {key: _settings(params, name)[key] for key in ("algorithm", "options", "local")} for name in names
    }
    summary = {"algorithms": list(names), "rounds": params.federated.rounds, "settings": settings}
    inputs = (*metrics, PARTITION_METRICS)
    members = tuple(dict.fromkeys(module for name in names for module in _members(params, name)))
    waves.append([Step("federated/summary", "tasks.federated:summarise_rounds", summary, inputs, members=members)])
    return waves


def _heads_step(params: Params, name: str, latest: list[int]) -> Step:
    """Entry ``name``'s FedBABU fine-tuning of every client's head on the final body, which writes the last
    round's models."""
    rounds = params.federated.rounds
    poisoned = [k for k in range(params.num_clients) if _data_attack(params, k)]
    attack, members = {}, _members(params, name)
    if poisoned:
        declaration = params.federated.attack.declaration
        attack, members = {"attack": declaration.name, "poisoned": poisoned}, members + (declaration.module,)
    step_params = {
        **_settings(params, name),
        **_evaluation_settings(params),
        **_task_settings(params),
        **attack,
        "round": rounds,
        "head_rounds": latest,
        "head_epochs": params.federated.head_epochs,
    }
    states = tuple(client_state_file(name, last, k) for k, last in enumerate(latest))
    clients = tuple(path for ref in params.clients for path in _client_inputs(ref)[1:])
    return Step(
        f"federated/{name}/heads",
        "tasks.federated:finetune_heads",
        step_params,
        (*_evaluation_inputs(params), server_file(name, rounds), PARTITION_METRICS, *states, *dict.fromkeys(clients)),
        settings=device_settings(params),
        members=members,
    )


def _save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    with atomic_path(path) as tmp:
        save_file(on_cpu(tensors), str(tmp), metadata=metadata)


def _save_state(path: Path, state: dict[str, torch.Tensor]) -> None:
    if state:
        _save(path, state)


def _load_state(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A client's state as ``_save_state`` left it (an empty one has no file), on ``device``."""
    return load_file(path, device=device) if path.is_file() else {}


def _test_data(root: Path, task: str | None = None) -> tuple[ClientData, float | None]:
    directory = TaskPaths(task).prepared
    info = read_info(root, directory)
    X, y = read_arrays(root / directory / "test.parquet", info)
    return ClientData(torch.as_tensor(X), torch.as_tensor(y), info["task"]), info.get("noise_std")


def validation_data(root: Path, task: str | None = None) -> ClientData:
    """The prepared validation split of ``task`` (written when ``data.validation_fraction`` > 0)."""
    directory = TaskPaths(task).prepared
    info = read_info(root, directory)
    X, y = read_arrays(root / directory / "validation.parquet", info)
    return ClientData(torch.as_tensor(X), torch.as_tensor(y), info["task"])


def _client_data(root: Path, task: str | None, client: int, attack: str | None = None) -> ClientData:
    """A client's partition (its task's description), with its labels flipped by a data attack."""
    info = json.loads((root / TaskPaths(task).partitions_info).read_text())
    X, y = read_arrays(root / client_file(client), info)
    data = ClientData(torch.as_tensor(X), torch.as_tensor(y), info["task"])
    return ATTACKS.lookup(attack).load()(data, int(info["num_classes"])) if attack else data


def _sizes(root: Path) -> dict[int, int]:
    """Every client's number of examples, by global id."""
    return dict(enumerate(json.loads((root / PARTITION_METRICS).read_text())["sizes"]))


def loop_inputs(root: Path, num_clients: int) -> tuple[Callable[[], torch.nn.Module], list[ClientData], ClientData]:
    """What ``mergeflow.federated.run_rounds`` needs to redo this stage from a workspace's files.

    The base model's builder, every client's data and the test data, read as the stage's steps
    read them, so the plain loop on these inputs reproduces the stage's numbers bit for bit.
    """
    base_state, base_meta = load_checkpoint(root / TaskPaths().base)

    def model_builder() -> torch.nn.Module:
        model = build_from_spec(base_meta["spec"])
        model.load_state_dict(base_state)
        return model

    return model_builder, [_client_data(root, None, k) for k in range(num_clients)], _test_data(root)[0]


def _client_states(root: Path, params: dict[str, Any], device: str = "cpu") -> dict[int, dict[str, torch.Tensor]]:
    """Every client's latest state (``head_rounds``: the round each was last written in)."""
    name = params["name"]
    return {k: _load_state(root / client_state_file(name, r, k), device) for k, r in enumerate(params["head_rounds"])}


def _write_models(
    root: Path,
    out: Path,
    params: dict[str, Any],
    settings: dict[str, Any],
    server: dict,
    row: dict,
    states: dict[int, dict[str, torch.Tensor]] | None = None,
) -> None:
    """Each task's model after round ``row["round"]`` (the global model, or the global body with the task's
    clients' average head from ``states``) as a checkpoint, and the round's ``row`` with the metrics: the
    task's, or in a multi-task run their mean over the tasks with each task's under ``tasks``."""
    algorithm = get_algorithm(params["algorithm"])
    round_index = row["round"]
    sizes = _sizes(root) if states is not None else {}
    scores = {}
    for task, clients in _task_clients(params).items():
        paths, heads = TaskPaths(task), _heads(root, params, task)
        state = algorithm.global_state(server)
        model = federated_model(root, params, task)
        if heads is not None:
            head = clients_head(states, sizes, clients)
            state |= head
            heads.load(heads.prepare(model), head)
        weights = _global_weights(root, params, state, task)
        spec = load_checkpoint_meta(root / paths.base)["spec"]
        meta = {"spec": spec, "role": "federated", "algorithm": params["algorithm"], "round": round_index}
        save_checkpoint(out / paths.global_checkpoint(params["name"], round_index), weights, meta)
        scores[task] = _scores(root, params, algorithm, server, model.to(step_device(settings)), task, round_index)
    summary = scores[None] if None in scores else _mean_over_tasks(scores)
    write_json(out / round_metrics_file(params["name"], round_index), {**row, **summary})


def _scores(
    root: Path, params: dict[str, Any], algorithm, server: dict, model: torch.nn.Module, task: str | None, r: int
) -> dict[str, float]:
    """A task's model's test (and validation) metrics, in the target's own units as the evaluation's are."""
    data, noise = _test_data(root, task)
    noise_std, samples, seed = noise or params["noise_std"], params["predictive_samples"], params["seed"]
    validation = validation_data(root, task) if params["validation"] else None
    scores = global_scores(algorithm, server, model, data, validation, noise_std, samples, seed, r)
    return get_objective(data.task).in_target_units(
        scores, target_scale(read_info(root, TaskPaths(task).prepared))["std"]
    )


def _mean_over_tasks(scores: dict[str | None, dict[str, float]]) -> dict[str, Any]:
    """Each metric's mean over the tasks (those every task has), and each task's metrics under ``tasks``."""
    shared = set.intersection(*(set(task_scores) for task_scores in scores.values()))
    means = {key: sum(task_scores[key] for task_scores in scores.values()) / len(scores) for key in sorted(shared)}
    return means | {"tasks": scores}


def init_rounds(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Round 0: the server and client states from the base model (each client's head from its task's), and
    the base model's metrics."""
    algorithm = get_algorithm(params["algorithm"])
    options = algorithm.parse_options(params["options"])
    groups = _task_clients(params)
    first = next(iter(groups))
    if params.get("adapters"):
        initial = model_parameters(federated_model(root, params))
    else:
        heads = _heads(root, params, first)
        own = set(heads.names) if heads is not None else set()
        base = load_checkpoint(root / TaskPaths(first).base)[0]
        initial = {k: v for k, v in base.items() if v.is_floating_point() and k not in own}
    server = algorithm.init_server(initial, params["num_clients"], options)
    _save(out / server_file(params["name"], 0), server)
    states = {}
    for task, clients in groups.items():
        heads = _heads(root, params, task)
        head = heads.head_of(load_checkpoint(root / TaskPaths(task).base)[0]) if heads is not None else {}
        for k in clients:
            state = algorithm.init_client(initial, options)
            states[k] = heads.with_head(state, head) if heads is not None else state
            _save_state(out / client_state_file(params["name"], 0, k), states[k])
    _write_models(root, out, params, settings, server, {"round": 0}, states)
    return {"algorithm": params["algorithm"]}


def client_round(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """One client's local update from the previous round's server state."""
    name, r, k, task = params["name"], params["round"], params["client"], params.get("task")
    algorithm = get_algorithm(params["algorithm"])
    device = step_device(settings)  # the model, server and client states on it; the data move by batches
    data = _client_data(root, task, k, params.get("attack"))
    message, state, metrics = client_step(
        algorithm,
        federated_model(root, params, task).to(device),
        load_file(root / server_file(name, r - 1), device=str(device)),
        _load_state(root / client_state_file(name, params["state_round"], k), str(device)),
        data,
        LocalTraining(**params["local"]),
        algorithm.parse_options(params["options"]),
        params["seed"],
        r,
        k,
        heads=_heads(root, params, task),
    )
    # A diverged client (message None) sends an empty message and keeps its state: the server
    # step applies federated.on_divergence, so changing the policy re-runs no client update.
    _save_message(out / message_file(name, r, k), message or {}, metrics)
    _save_state(out / client_state_file(name, r, k), state)
    return {"num_examples": len(data), **metrics}


def server_round(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The server update from this round's messages, then the new models' test metrics (under ``frozen``, the
    last round's are the heads step's: the server state's header then carries the round's row)."""
    name, r, participants = params["name"], params["round"], params["participants"]
    algorithm = get_algorithm(params["algorithm"])
    options = algorithm.parse_options(params["options"])
    device = str(step_device(settings))  # the aggregation (robust rules, DP noise, server optimizers) runs there
    server = load_file(root / server_file(name, r - 1), device=device)
    sent = {k: read_message(root / message_file(name, r, k), device) for k in participants}
    try:
        plan = _server_plan(params, _first_info(root, params).get("num_classes"))
        updated, row = server_step(
            algorithm, server, sent, _sizes(root), params["num_clients"], options, params["on_divergence"], r, plan
        )
    except (DivergenceError, ValueError) as error:
        raise MergeflowError(f"federated.algorithms: {name}: {error}") from None
    if params.get("head_finetuning"):
        _save(out / server_file(name, r), updated, {_ROW_KEY: json.dumps(row, sort_keys=True)})
        return {"round": r}
    _save(out / server_file(name, r), updated)
    states = _client_states(root, params) if "heads" in params else None
    _write_models(root, out, params, settings, updated, {"round": r, **row}, states)
    return {"round": r}


def _first_info(root: Path, params: dict[str, Any]) -> dict[str, Any]:
    """The description of the first task's prepared data."""
    return read_info(root, TaskPaths(next(iter(_task_clients(params)))).prepared)


def finetune_heads(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """FedBABU's last phase: every client fine-tunes its head on the final global body; then the last round's
    models (the body with each task's clients' average fine-tuned head) and metrics."""
    name, r = params["name"], params["round"]
    algorithm = get_algorithm(params["algorithm"])
    device = step_device(settings)
    with safe_open(str(root / server_file(name, r)), framework="pt", device=str(device)) as f:
        row = json.loads(f.metadata()[_ROW_KEY])
        server = {key: f.get_tensor(key) for key in f.keys()}
    states = _client_states(root, params, str(device))
    train = LocalTraining(**params["local"])
    for task, clients in _task_clients(params).items():
        heads = _heads(root, params, task)
        for k in clients:
            data = _client_data(root, task, k, params["attack"] if k in params.get("poisoned", ()) else None)
            model = federated_model(root, params, task).to(device)
            try:
                states[k] = head_step(algorithm, heads, model, server, states[k], data, train, params["seed"], r, k)
            except DivergenceError as error:
                raise MergeflowError(f"federated.head_epochs: {name}: client {k}: {error}") from None
    _write_models(root, out, params, settings, server, {"round": r, **row}, states)
    return {"round": r, "clients": len(states)}


def summarise_rounds(params: dict[str, Any], root: Path, out: Path, _settings: dict[str, Any]) -> dict[str, Any]:
    """Per-round metrics of every algorithm in one file, the accuracy-vs-round plot, and each algorithm's
    stability warning (in round 0's metrics and the index), computed here so that a change of the rounds
    asked for re-runs no finished round."""
    curves = {
        name: [json.loads((root / round_metrics_file(name, r)).read_text()) for r in range(params["rounds"] + 1)]
        for name in params["algorithms"]
    }
    sizes = json.loads((root / PARTITION_METRICS).read_text())["sizes"]
    warnings = {}
    for name, curve in curves.items():
        settings = params["settings"][name]
        algorithm = get_algorithm(settings["algorithm"])
        options = algorithm.parse_options(settings["options"])
        local = LocalTraining(**settings["local"])
        if warning := algorithm.stability_warning(sizes, local, params["rounds"], options):
            warnings[name] = curve[0]["warning"] = warning  # round 0, as the plain loop reports it
    write_json(out / FEDERATED_METRICS, curves)
    index = {"algorithms": params["algorithms"], "rounds": params["rounds"], "warnings": warnings}
    write_json(out / FEDERATED_INDEX, index)
    plot_rounds(curves, out / FEDERATED_PLOT)
    return {"algorithms": len(curves)}
