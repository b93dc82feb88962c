"""Steps of the ``pretrain``, ``finetune`` and ``centralized`` stages."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mergeflow.checkpoints import load_checkpoint, save_checkpoint
from mergeflow.config import Params
from mergeflow.errors import MergeflowError
from mergeflow.models import build_from_spec, family_of
from mergeflow.objectives import get_objective
from mergeflow.seeding import derive_seed
from mergeflow.training import DivergenceError, TrainResult, predict, train
from tasks.given_sources import given_of, given_params, resolved_source
from tasks.layout import (
    BASE,
    CENTRALIZED,
    CORPUS,
    PARTITIONS,
    PREPARED,
    SINGLE_TASK,
    TaskPaths,
    client_checkpoint,
    client_file,
)
from tasks.prepared import read_arrays, read_info
from tasks.step_devices import device_settings, on_cpu, step_device
from tasks.steps import Step

_TRAIN_KEYS = ("epochs", "lr", "optimizer", "momentum", "weight_decay", "batch_size")
_FP32 = "fp32"


def _fit(
    model,
    X: np.ndarray,
    y: np.ndarray,
    task: str,
    settings: dict[str, Any],
    seed: int,
    label: str,
    on_epoch: Callable[[int], None] | None = None,
):
    """Train with ``settings`` (in their ``precision``, fp32 by default); with a ``lora`` entry, LoRA adapters and
    the head only, folded in afterwards."""
    train_settings = {k: settings[k] for k in _TRAIN_KEYS} | {"precision": settings.get("precision", _FP32)}
    if not settings.get("lora"):
        return train(model, X, y, task=task, seed=seed, progress=label, on_epoch=on_epoch, **train_settings)
    from mergeflow.models.lora import lora

    with lora(model, settings["lora"], derive_seed(seed, "lora")):
        return train(model, X, y, task=task, seed=seed, progress=label, on_epoch=on_epoch, **train_settings)


def plan_pretrain(params: Params) -> list[Step]:
    """One step: the shared base model (in a multi-task run, its body with each task's own head); none when
    ``pretrain.checkpoint`` gives it (:mod:`tasks.given` plans that)."""
    if params.pretrain.checkpoint is not None and not params.multitask:
        return []
    pretraining = params.pretrain.model_dump(mode="json", exclude={"checkpoint"})  # the keys of steps made before it
    step_params = {"seed": params.seed, "model": params.section("model"), "pretrain": pretraining}
    inputs: tuple[str, ...] = (PREPARED,)
    if params.multitask:
        step_params["tasks"] = list(params.tasks)
        if params.pretrain.checkpoint is not None:  # the body given: each task's head is made here
            given = resolved_source("pretrain.checkpoint", params.pretrain.checkpoint)
            step_params["given"] = given_params(given)
            inputs += tuple(given.files)
    fn = "tasks.training:pretrain_tasks" if params.multitask else "tasks.training:pretrain"
    return [Step("pretrain", fn, step_params, inputs, device_settings(params), members=params.model_members)]


def pretrain(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Initialise the base model from the shared seed and train it on the server split if enabled."""
    info = read_info(root)
    model, spec = _base_model(params["model"], info, derive_seed(params["seed"], "init"))
    model.to(step_device(settings))
    pretraining = params["pretrain"]
    losses: list[float] = []
    meta: dict[str, Any] = {"spec": spec, "role": "base"}
    server = root / PREPARED / "server.parquet"
    if pretraining.get("language_model"):
        losses_and_tokens = _pretrain_language_model(model, root, info, pretraining, params["seed"])
        meta["language_model_losses"], meta["language_model_tokens"] = losses_and_tokens
    if pretraining["enabled"] and server.is_file():
        X, y = read_arrays(server, info)
        result = _fit(model, X, y, info["task"], pretraining, derive_seed(params["seed"], "pretrain"), "pretrain")
        losses = result.epoch_losses
    save_checkpoint(out / BASE, model.state_dict(), meta | {"epoch_losses": losses})
    return {"trained": bool(losses), "language_model_losses": meta.get("language_model_losses")}


def pretrain_tasks(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The base model of every task: one body (the first task's data describes its inputs), each task's own
    head (seeded by its name), pre-trained jointly on the tasks' server splits if enabled (one body, K heads:
    :func:`mergeflow.multitask.train_jointly`)."""
    from mergeflow.given_weights import read_given
    from mergeflow.heads import head_names, task_base
    from mergeflow.multitask import train_jointly

    tasks = params["tasks"]
    infos = {task: read_info(root, TaskPaths(task).prepared) for task in tasks}
    _check_inputs_agree(infos)
    seed = params["seed"]
    first = infos[tasks[0]]
    model, spec = _base_model(params["model"], first, derive_seed(seed, "init"))
    state = model.state_dict()
    if "given" in params:  # a given base (the first task's), checked against the model the params describe
        given = given_of(params["given"])
        try:
            spec, state = read_given(given, state, spec)
        except ValueError as error:
            raise MergeflowError(f"{given.key}: {error}") from None
    models, specs = {}, {}
    for task in tasks:
        output_dim = get_objective(infos[task]["task"]).output_dim(infos[task])
        specs[task], task_state = task_base(spec, state, output_dim, derive_seed(seed, "head", task))
        models[task] = build_from_spec(specs[task])
        models[task].load_state_dict(task_state)
        models[task].to(step_device(settings))
    pretraining = params["pretrain"]
    servers = {task: root / TaskPaths(task).prepared / "server.parquet" for task in tasks}
    losses: list[float] = []
    if pretraining["enabled"] and all(path.is_file() for path in servers.values()):
        data = {task: read_arrays(servers[task], infos[task]) for task in tasks}
        train_settings = {k: pretraining[k] for k in _TRAIN_KEYS}
        objective = first["task"]
        heads = head_names(spec)
        result = train_jointly(
            models, data, heads=heads, task=objective, seed=derive_seed(seed, "pretrain"), **train_settings
        )
        losses = result.epoch_losses
    for task in tasks:
        meta = {"spec": specs[task], "role": "base", "task": task, "epoch_losses": losses}
        save_checkpoint(out / TaskPaths(task).base, on_cpu(models[task].state_dict()), meta)
    return {"trained": bool(losses), "tasks": len(tasks)}


def _check_inputs_agree(infos: dict[str, dict[str, Any]]) -> None:
    """The tasks share one body: their inputs must have one shape (and one tokenizer's ids)."""
    shapes = {task: info.get("input_shape") for task, info in infos.items()}
    if len({json.dumps(shape) for shape in shapes.values()}) > 1:
        listed = ", ".join(f"{task} {shape}" for task, shape in shapes.items())
        raise MergeflowError(f"tasks: the tasks share one body, and their inputs differ in shape ({listed})")


def _pretrain_language_model(
    model, root: Path, info: dict[str, Any], settings: dict[str, Any], seed: int
) -> tuple[list[float], int]:
    """Masked- or causal-LM pre-training of a transformer's body on the server (and training) text;
    its per-epoch losses and the number of (non-padding) tokens it processed."""
    from mergeflow.models.language_model import SpecialIds, pretrain_language_model

    lm = settings["language_model"]
    splits = {"server": ["server"], "train": ["server", "train"], "corpus": [CORPUS]}[lm["text"]]
    files = [root / PREPARED / f"{name}.parquet" for name in splits]
    ids = torch.as_tensor(np.concatenate([read_arrays(f, info)[0] for f in files if f.is_file()]))
    tokens = info["tokenizer"]
    special = SpecialIds(tokens["pad_token_id"], tokens["mask_token_id"], tuple(tokens["special_ids"]))
    objective = lm["objective"] if lm["objective"] != "auto" else ("clm" if model.causal else "mlm")
    processed = int((ids != tokens["pad_token_id"]).sum()) * lm["epochs"]
    losses = pretrain_language_model(
        model,
        ids,
        special,
        objective=objective,
        epochs=lm["epochs"],
        lr=lm["lr"],
        batch_size=lm["batch_size"],
        mask_probability=lm["mask_probability"],
        seed=derive_seed(seed, "language_model"),
    )
    return losses, processed


def _base_model(model_cfg: dict[str, Any], info: dict[str, Any], seed: int) -> tuple[torch.nn.Module, dict]:
    """The untrained base model of ``model_cfg`` for the data ``info`` describes, and its spec."""
    output_dim = get_objective(info["task"]).output_dim(info)
    return family_of(model_cfg["arch"]).build_base(model_cfg, info, output_dim, seed)


def _client_settings(params: Params, client: int) -> dict[str, Any]:
    """A client's training settings (with its overrides), and the LoRA settings when set."""
    override = params.finetune.clients.get(client)
    settings = params.finetune.with_override(override).model_dump(include=set(_TRAIN_KEYS))
    return settings | _precision(params) | ({"lora": params.section("finetune.lora")} if params.finetune.lora else {})


def _precision(params: Params) -> dict[str, str]:
    """``finetune.precision`` for a training step's params (and so its key), left out at fp32: the keys of
    steps made before precision was a setting stay valid."""
    precision = params.finetune.precision
    return {"precision": precision} if precision != _FP32 else {}


def plan_finetune(params: Params) -> list[Step]:
    """One step per client trained here (not given in ``finetune.checkpoints``: :mod:`tasks.given` plans those),
    keyed by that client's own settings and partition only (and, in a multi-task run, its task's base)."""
    steps, given = [], params.given_clients
    for ref in params.clients:
        if ref.index in given:
            continue
        paths = TaskPaths(ref.task)
        step_params = {
            "seed": params.seed,
            "client": ref.index,
            "init": params.finetune.init,
            "train": _client_settings(params, ref.index),
        }
        if ref.task is not None:
            step_params["task"] = ref.task
        inputs = (paths.base, client_file(ref.index), paths.partitions_info)
        name, fn = f"finetune/client_{ref.index:03d}", "tasks.training:finetune_client"
        steps.append(Step(name, fn, step_params, inputs, device_settings(params), members=params.model_members))
    return steps


def _start_model(root: Path, init_seed: int | None = None, device: torch.device | None = None, base: str = BASE):
    """The base model (``base``: a task's), or a fresh random init of its architecture with ``init_seed``, on
    ``device`` (the CPU by default); and its spec."""
    state, meta = load_checkpoint(root / base)
    spec = meta["spec"] if init_seed is None else {**meta["spec"], "seed": init_seed}
    model = build_from_spec(spec)
    if init_seed is None:
        model.load_state_dict(state)
    return model.to(device or "cpu"), spec


def _train_from_base(
    root: Path,
    X: np.ndarray,
    y: np.ndarray,
    settings: dict[str, Any],
    seed: int,
    label: str,
    init_seed: int | None = None,
    device: torch.device | None = None,
    paths: TaskPaths = SINGLE_TASK,
):
    """Train from the start model (see ``_start_model``) on ``device``."""
    info = read_info(root, paths.partitions)
    model, spec = _start_model(root, init_seed, device, paths.base)
    result = _fit(model, X, y, info["task"], settings, seed, label)
    return model, spec, result


def finetune_client(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Fine-tune the base model on one client's partition."""
    client, paths = params["client"], TaskPaths(params.get("task"))
    info = read_info(root, paths.partitions)
    X, y = read_arrays(root / client_file(client), info)
    seed = derive_seed(params["seed"], "finetune", client)
    init_seed = derive_seed(params["seed"], "init", client) if params["init"] == "independent" else None
    try:
        device = step_device(settings)
        label = f"client {client}"
        model, spec, result = _train_from_base(root, X, y, params["train"], seed, label, init_seed, device, paths)
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            raise DivergenceError("non-finite weights after training")
    except DivergenceError as error:
        # Kept as a valid checkpoint (the start weights) with the reason: the align stage
        # applies finetune.on_divergence, so changing it re-trains nothing.
        model, spec = _start_model(root, init_seed, base=paths.base)
        result = TrainResult()
        meta_extra = {"diverged": True, "divergence": str(error)}
    else:
        meta_extra = {"diverged": False}
    meta = {
        "spec": spec,
        "role": "client",
        "client": client,
        **({"task": paths.task} if paths.task else {}),
        "num_examples": len(y),
        "init": params["init"],
        "train": params["train"],
        "step_losses": result.losses,
        "epoch_losses": result.epoch_losses,
        **meta_extra,
    }
    save_checkpoint(out / client_checkpoint(client), model.state_dict(), meta)
    final_loss = result.epoch_losses[-1] if result.epoch_losses else None
    return {"num_examples": len(y), "final_loss": final_loss, "diverged": meta_extra["diverged"]}


def plan_centralized(params: Params) -> list[Step]:
    """One step: the oracle trained on all client data pooled (the split once when clients replicate it), with
    the fine-tuning defaults (and ``centralized``'s epochs); with ``keep: best_validation``, its best epoch on the
    validation split."""
    settings = params.finetune.model_dump(include=set(_TRAIN_KEYS))
    if params.centralized.epochs is not None:
        settings["epochs"] = params.centralized.epochs
    if params.finetune.lora:
        settings["lora"] = params.section("finetune.lora")
    settings |= _precision(params)
    if not params.centralized.enabled:
        return []
    if params.multitask:
        return [_ceiling_step(params, settings)]
    files = tuple(client_file(c) for c in range(params.partition.num_clients) if params.partition.pooled(c))
    best = params.centralized.keep == "best_validation"
    step_params = {"seed": params.seed, "train": settings, "num_clients": len(files)}
    if best:
        step_params |= {
            "keep": "best_validation",
            "select_by": params.merge.selection_metric(params.objective),
            "noise_std": params.evaluate.noise_std,
        }
    validation = (f"{PREPARED}/validation.parquet", f"{PREPARED}/info.json") if best else ()
    return [
        Step(
            "centralized",
            "tasks.training:centralized",
            step_params,
            inputs=(BASE, f"{PARTITIONS}/info.json", *files, *validation),
            settings=device_settings(params),
            members=params.model_members,
        )
    ]


def centralized(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Train from the base model on the union of the client partitions; with ``keep: best_validation``,
    keep the weights of the epoch that scores best on the validation split."""
    info = read_info(root, PARTITIONS)
    clients = range(params["num_clients"])
    arrays = [read_arrays(root / client_file(c), info) for c in clients]
    X = np.concatenate([a[0] for a in arrays])
    y = np.concatenate([a[1] for a in arrays])
    seed = derive_seed(params["seed"], "centralized")
    model, spec = _start_model(root, device=step_device(settings))
    best = params.get("keep") == "best_validation"
    tracker = _BestEpoch(root, model, params["select_by"], params["noise_std"]) if best else None
    result = _fit(model, X, y, info["task"], params["train"], seed, "centralized", tracker)
    meta = {"spec": spec, "role": "centralized", "num_examples": len(y), "epoch_losses": result.epoch_losses}
    if tracker is not None and tracker.best_state is not None:
        model.load_state_dict(tracker.best_state)
        meta |= {"best_epoch": tracker.best_epoch, "validation_curve": tracker.curve, "split": "validation"}
    save_checkpoint(out / CENTRALIZED, model.state_dict(), meta)
    return {"num_examples": len(y), **({"best_epoch": tracker.best_epoch} if tracker else {})}


def _ceiling_step(params: Params, settings: dict[str, Any]) -> Step:
    """A multi-task run's ceiling: one body trained jointly on every task's clients' data, with K heads."""
    clients: dict[str, list[int]] = {task: [] for task in params.tasks}
    for ref in params.clients:
        if params.partition.pooled(ref.local):
            clients[ref.task].append(ref.index)
    inputs = [path for task in params.tasks for path in (TaskPaths(task).base, TaskPaths(task).partitions_info)]
    inputs += [client_file(index) for indices in clients.values() for index in indices]
    step_params = {"seed": params.seed, "train": settings, "clients": clients}
    fn = "tasks.training:centralized_tasks"
    return Step("centralized", fn, step_params, tuple(inputs), device_settings(params), members=params.model_members)


def centralized_tasks(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The multi-task ceiling (the analogue of the centralized oracle): from the shared base, one body trained
    jointly on every task's pooled client data, each task with its own head
    (:func:`mergeflow.multitask.train_jointly`); each task's view of it is saved as its ``centralized`` model."""
    from mergeflow.heads import head_names
    from mergeflow.multitask import train_jointly

    models, specs, data = {}, {}, {}
    device = step_device(settings)
    for task, clients in params["clients"].items():
        paths = TaskPaths(task)
        info = read_info(root, paths.partitions)
        arrays = [read_arrays(root / client_file(c), info) for c in clients]
        data[task] = (np.concatenate([a[0] for a in arrays]), np.concatenate([a[1] for a in arrays]))
        models[task], specs[task] = _start_model(root, device=device, base=paths.base)
        objective = info["task"]
    train_settings = {k: params["train"][k] for k in _TRAIN_KEYS}
    precision = params["train"].get("precision", _FP32)
    seed = derive_seed(params["seed"], "centralized")
    heads = head_names(next(iter(specs.values())))
    result = train_jointly(models, data, heads=heads, task=objective, seed=seed, precision=precision, **train_settings)
    for task, model in models.items():
        meta = {
            "spec": specs[task],
            "role": "centralized",
            "task": task,
            "num_examples": len(data[task][1]),
            "epoch_losses": result.epoch_losses,
        }
        save_checkpoint(out / TaskPaths(task).centralized, on_cpu(model.state_dict()), meta)
    return {"num_examples": {task: len(y) for task, (_, y) in data.items()}}


class _BestEpoch:
    """Scores a model on the validation split after each epoch and keeps a copy of the best weights."""

    def __init__(self, root: Path, model: torch.nn.Module, select_by: str, noise_std: float) -> None:
        from tasks.scoring import score_outputs

        info = read_info(root)
        X, y = read_arrays(root / PREPARED / "validation.parquet", info)
        self.score = lambda: score_outputs(predict(model, X, task=info["task"]), y, info, noise_std)
        self.model, self.select_by = model, select_by
        self.curve: list[dict[str, float]] = []
        self.best_epoch: int | None = None
        self.best_state: dict[str, torch.Tensor] | None = None

    def __call__(self, epoch: int) -> None:
        from mergeflow.schema.search import choose

        self.curve.append(self.score())
        if choose(self.curve, self.select_by) == epoch:
            self.best_epoch = epoch + 1
            self.best_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
