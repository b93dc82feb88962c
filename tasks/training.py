"""Steps of the ``pretrain``, ``finetune`` and ``centralized`` stages."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mergeflow.checkpoints import load_checkpoint, save_checkpoint
from mergeflow.config import Params
from mergeflow.models import build_from_spec, family_of
from mergeflow.objectives import get_objective
from mergeflow.seeding import derive_seed
from mergeflow.training import DivergenceError, TrainResult, predict, train
from tasks.layout import BASE, CENTRALIZED, CORPUS, PARTITIONS, PREPARED, client_checkpoint, client_file
from tasks.prepared import read_arrays, read_info
from tasks.step_devices import device_settings, step_device
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
    """One step: the shared base model; none when ``pretrain.checkpoint`` gives it (:mod:`tasks.given` plans that)."""
    if params.pretrain.checkpoint is not None:
        return []
    pretraining = params.pretrain.model_dump(mode="json", exclude={"checkpoint"})  # the keys of steps made before it
    step_params = {"seed": params.seed, "model": params.section("model"), "pretrain": pretraining}
    return [
        Step(
            "pretrain",
            "tasks.training:pretrain",
            step_params,
            inputs=(PREPARED,),
            settings=device_settings(params),
            members=params.model_members,
        )
    ]


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
    keyed by that client's own settings and partition only."""
    return [
        Step(
            f"finetune/client_{client:03d}",
            "tasks.training:finetune_client",
            {
                "seed": params.seed,
                "client": client,
                "init": params.finetune.init,
                "train": _client_settings(params, client),
            },
            inputs=(BASE, client_file(client), f"{PARTITIONS}/info.json"),
            settings=device_settings(params),
            members=params.model_members,
        )
        for client in range(params.partition.num_clients)
        if client not in params.finetune.checkpoints
    ]


def _start_model(root: Path, init_seed: int | None = None, device: torch.device | None = None):
    """The base model, or a fresh random init of its architecture with ``init_seed``, on ``device`` (the
    CPU by default); and its spec."""
    state, meta = load_checkpoint(root / BASE)
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
):
    """Train from the start model (see ``_start_model``) on ``device``."""
    info = read_info(root, PARTITIONS)
    model, spec = _start_model(root, init_seed, device)
    result = _fit(model, X, y, info["task"], settings, seed, label)
    return model, spec, result


def finetune_client(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Fine-tune the base model on one client's partition."""
    client = params["client"]
    info = read_info(root, PARTITIONS)
    X, y = read_arrays(root / client_file(client), info)
    seed = derive_seed(params["seed"], "finetune", client)
    init_seed = derive_seed(params["seed"], "init", client) if params["init"] == "independent" else None
    try:
        device = step_device(settings)
        model, spec, result = _train_from_base(root, X, y, params["train"], seed, f"client {client}", init_seed, device)
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            raise DivergenceError("non-finite weights after training")
    except DivergenceError as error:
        # Kept as a valid checkpoint (the start weights) with the reason: the align stage
        # applies finetune.on_divergence, so changing it re-trains nothing.
        model, spec = _start_model(root, init_seed)
        result = TrainResult()
        meta_extra = {"diverged": True, "divergence": str(error)}
    else:
        meta_extra = {"diverged": False}
    meta = {
        "spec": spec,
        "role": "client",
        "client": client,
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
    """One step: the oracle trained on all client data pooled, with the fine-tuning defaults (and
    ``centralized``'s epochs); with ``keep: best_validation``, its best epoch on the validation split."""
    settings = params.finetune.model_dump(include=set(_TRAIN_KEYS))
    if params.centralized.epochs is not None:
        settings["epochs"] = params.centralized.epochs
    if params.finetune.lora:
        settings["lora"] = params.section("finetune.lora")
    settings |= _precision(params)
    files = tuple(client_file(c) for c in range(params.partition.num_clients))
    best = params.centralized.keep == "best_validation"
    step_params = {"seed": params.seed, "train": settings, "num_clients": params.partition.num_clients}
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
