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
the plain loop bit for bit.
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
from mergeflow.config import Params
from mergeflow.data.encode import target_scale
from mergeflow.errors import MergeflowError
from mergeflow.federated import (
    ClientData,
    LocalTraining,
    get_algorithm,
    load_parameters,
    model_parameters,
)
from mergeflow.federated.loop import global_scores
from mergeflow.federated.rounds import client_step, round_schedule, server_step
from mergeflow.federated.server_plan import ServerPlan, attackers
from mergeflow.files import atomic_path, write_json
from mergeflow.models import build_from_spec
from mergeflow.objectives import get_objective
from mergeflow.plots import plot_rounds
from mergeflow.schema.federated import ALGORITHMS, ATTACKS, Attack, server_step_members
from mergeflow.seeding import derive_seed
from mergeflow.training import DivergenceError
from tasks.layout import (
    BASE,
    FEDERATED_INDEX,
    FEDERATED_METRICS,
    FEDERATED_PLOT,
    PARTITION_METRICS,
    PARTITIONS,
    PREPARED,
    client_file,
    client_state_file,
    global_checkpoint,
    message_file,
    round_metrics_file,
    server_file,
)
from tasks.prepared import read_arrays, read_info
from tasks.step_devices import device_settings, on_cpu, step_device
from tasks.steps import Step

_METRICS_KEY = "mergeflow.metrics"


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
    return {
        "name": name,
        "algorithm": algorithm,
        "options": options.model_dump(mode="json", exclude_unset=True),
        "local": params.federated.local_for(name).model_dump(mode="json"),
        "num_clients": params.partition.num_clients,
        "seed": params.seed,
        "noise_std": params.evaluate.noise_std,
    } | _exchange(params)


def _exchange(params: Params) -> dict[str, Any]:
    """The adapters clients exchange under ``federated.exchange: adapters`` (nothing for full models)."""
    if params.federated.exchange != "adapters":
        return {}
    return {"adapters": params.section("finetune.lora")}


def federated_model(root: Path, params: dict[str, Any]) -> torch.nn.Module:
    """The model a federated step trains and scores: the base architecture (its parameters come from the
    server state), or with exchanged adapters the base model itself, frozen, with LoRA adapters."""
    if not params.get("adapters"):
        return build_from_spec(load_checkpoint_meta(root / BASE)["spec"])
    from mergeflow.models.lora import attach_adapters

    base_state, base_meta = load_checkpoint(root / BASE)
    model = build_from_spec(base_meta["spec"])
    model.load_state_dict(base_state)
    return attach_adapters(model, params["adapters"], derive_seed(params["seed"], "federated", "adapters"))


def _global_weights(root: Path, params: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The global model's full weights: the server's parameters, or the base model with the global
    adapters folded in."""
    if not params.get("adapters"):
        base_state = load_checkpoint(root / BASE)[0]
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
    return attack.declaration if client in attackers(params.partition.num_clients, attack, params.seed) else None


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


def plan_federated(params: Params) -> list[list[Step]]:
    """Waves: init, then (clients, server) per round, then the summary."""
    names = params.federated.algorithms
    evaluation = (BASE, f"{PREPARED}/test.parquet", f"{PREPARED}/info.json")
    if params.data.validation_fraction > 0:
        evaluation += (f"{PREPARED}/validation.parquet",)
    waves = [
        [
            Step(
                f"federated/{name}/init",
                "tasks.federated:init_rounds",
                {**_settings(params, name), **_evaluation_settings(params)},
                evaluation,
                settings=device_settings(params),
                members=_members(params, name),
            )
            for name in names
        ]
    ]
    federated = params.federated
    poisson = federated.dp is not None
    schedule = round_schedule(
        params.partition.num_clients, federated.rounds, federated.fraction, params.seed, poisson=poisson
    )
    for step in schedule:
        r, clients, servers = step.number, [], []
        for name in names:
            settings = _settings(params, name)
            for k in step.participants:
                inputs = (
                    BASE,
                    server_file(name, r - 1),
                    client_state_file(name, step.state_rounds[k], k),
                    client_file(k),
                    f"{PARTITIONS}/info.json",
                )
                step_params = {**settings, "round": r, "client": k, "state_round": step.state_rounds[k]}
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
            servers.append(
                Step(
                    f"federated/{name}/r{r:03d}/server",
                    "tasks.federated:server_round",
                    {
                        **settings,
                        **_evaluation_settings(params),
                        **_server_settings(params, name),
                        "round": r,
                        "participants": step.participants,
                    },
                    (*evaluation, server_file(name, r - 1), PARTITION_METRICS, *messages),
                    settings=device_settings(params),
                    members=_server_members(params, name),
                )
            )
        waves += [clients, servers]
    metrics = tuple(round_metrics_file(name, r) for name in names for r in range(params.federated.rounds + 1))
    settings = {
        name: {key: _settings(params, name)[key] for key in ("algorithm", "options", "local")} for name in names
    }
    summary = {"algorithms": list(names), "rounds": params.federated.rounds, "settings": settings}
    inputs = (*metrics, PARTITION_METRICS)
    members = tuple(dict.fromkeys(module for name in names for module in _members(params, name)))
    waves.append([Step("federated/summary", "tasks.federated:summarise_rounds", summary, inputs, members=members)])
    return waves


def _save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    with atomic_path(path) as tmp:
        save_file(on_cpu(tensors), str(tmp), metadata=metadata)


def _save_state(path: Path, state: dict[str, torch.Tensor]) -> None:
    if state:
        _save(path, state)


def _load_state(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A client's state as ``_save_state`` left it (an empty one has no file), on ``device``."""
    return load_file(path, device=device) if path.is_file() else {}


def _test_data(root: Path) -> tuple[ClientData, float | None]:
    info = read_info(root)
    X, y = read_arrays(root / PREPARED / "test.parquet", info)
    return ClientData(torch.as_tensor(X), torch.as_tensor(y), info["task"]), info.get("noise_std")


def validation_data(root: Path) -> ClientData:
    """The prepared validation split (written when ``data.validation_fraction`` > 0)."""
    path = root / PREPARED / "validation.parquet"
    info = read_info(root)
    X, y = read_arrays(path, info)
    return ClientData(torch.as_tensor(X), torch.as_tensor(y), info["task"])


def loop_inputs(root: Path, num_clients: int) -> tuple[Callable[[], torch.nn.Module], list[ClientData], ClientData]:
    """What ``mergeflow.federated.run_rounds`` needs to redo this stage from a workspace's files.

    The base model's builder, every client's data and the test data, read as the stage's steps
    read them, so the plain loop on these inputs reproduces the stage's numbers bit for bit.
    """
    base_state, base_meta = load_checkpoint(root / BASE)

    def model_builder() -> torch.nn.Module:
        model = build_from_spec(base_meta["spec"])
        model.load_state_dict(base_state)
        return model

    info = read_info(root, PARTITIONS)
    clients = []
    for k in range(num_clients):
        X, y = read_arrays(root / client_file(k), info)
        clients.append(ClientData(torch.as_tensor(X), torch.as_tensor(y), info["task"]))
    return model_builder, clients, _test_data(root)[0]


def _write_global(
    root: Path, out: Path, params: dict[str, Any], settings: dict[str, Any], server: dict, round_index: int, row: dict
) -> None:
    """The global model as a checkpoint, and its metrics for this round."""
    algorithm = get_algorithm(params["algorithm"])
    weights = _global_weights(root, params, algorithm.global_state(server))
    spec = load_checkpoint_meta(root / BASE)["spec"]
    meta = {"spec": spec, "role": "federated", "algorithm": params["algorithm"], "round": round_index}
    save_checkpoint(out / global_checkpoint(params["name"], round_index), weights, meta)
    model = federated_model(root, params).to(step_device(settings))  # scored on the device
    data, noise = _test_data(root)
    noise_std, samples, seed = noise or params["noise_std"], params["predictive_samples"], params["seed"]
    validation = validation_data(root) if params["validation"] else None
    scores = global_scores(algorithm, server, model, data, validation, noise_std, samples, seed, round_index)
    # In the target's own units, as the evaluation's are.
    scores = get_objective(data.task).in_target_units(scores, target_scale(read_info(root))["std"])
    write_json(out / round_metrics_file(params["name"], round_index), {"round": round_index, **row, **scores})


def init_rounds(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Round 0: the server and client states from the base model, and the base model's metrics."""
    algorithm = get_algorithm(params["algorithm"])
    options = algorithm.parse_options(params["options"])
    if params.get("adapters"):
        initial = model_parameters(federated_model(root, params))
    else:
        initial = {k: v for k, v in load_checkpoint(root / BASE)[0].items() if v.is_floating_point()}
    server = algorithm.init_server(initial, params["num_clients"], options)
    _save(out / server_file(params["name"], 0), server)
    for k in range(params["num_clients"]):
        _save_state(out / client_state_file(params["name"], 0, k), algorithm.init_client(initial, options))
    _write_global(root, out, params, settings, server, 0, {})
    return {"algorithm": params["algorithm"]}


def client_round(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """One client's local update from the previous round's server state."""
    name, r, k = params["name"], params["round"], params["client"]
    algorithm = get_algorithm(params["algorithm"])
    info = read_info(root, PARTITIONS)
    X, y = read_arrays(root / client_file(k), info)
    device = step_device(settings)  # the model, server and client states on it; the data move by batches
    data = ClientData(torch.as_tensor(X), torch.as_tensor(y), info["task"])
    if params.get("attack"):
        data = ATTACKS.lookup(params["attack"]).load()(data, int(info["num_classes"]))
    message, state, metrics = client_step(
        algorithm,
        federated_model(root, params).to(device),
        load_file(root / server_file(name, r - 1), device=str(device)),
        _load_state(root / client_state_file(name, params["state_round"], k), str(device)),
        data,
        LocalTraining(**params["local"]),
        algorithm.parse_options(params["options"]),
        params["seed"],
        r,
        k,
    )
    # A diverged client (message None) sends an empty message and keeps its state: the server
    # step applies federated.on_divergence, so changing the policy re-runs no client update.
    _save_message(out / message_file(name, r, k), message or {}, metrics)
    _save_state(out / client_state_file(name, r, k), state)
    return {"num_examples": len(y), **metrics}


def server_round(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The server update from this round's messages, then the new global model's test metrics."""
    name, r, participants = params["name"], params["round"], params["participants"]
    algorithm = get_algorithm(params["algorithm"])
    options = algorithm.parse_options(params["options"])
    device = str(step_device(settings))  # the aggregation (robust rules, DP noise, server optimizers) runs there
    server = load_file(root / server_file(name, r - 1), device=device)
    sent = {k: read_message(root / message_file(name, r, k), device) for k in participants}
    sizes = dict(enumerate(json.loads((root / PARTITION_METRICS).read_text())["sizes"]))
    try:
        plan = _server_plan(params, read_info(root).get("num_classes"))
        updated, row = server_step(
            algorithm, server, sent, sizes, params["num_clients"], options, params["on_divergence"], r, plan
        )
    except (DivergenceError, ValueError) as error:
        raise MergeflowError(f"federated.algorithms: {name}: {error}") from None
    _save(out / server_file(name, r), updated)
    _write_global(root, out, params, settings, updated, r, row)
    return {"round": r}


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
