"""Steps of the models given instead of made: a client of ``finetune.checkpoints`` (a phase of the ``finetune``
stage, beside the clients trained there) and the base of ``pretrain.checkpoint`` (a phase of ``pretrain``).

Such a step trains nothing: it reads the given files into the run's format (:mod:`mergeflow.given_weights`), checks
them against the run's base model and data, and writes the checkpoint a trained one would, with where it came from
in its header (``given``: the source, its kind and each file's sha256). Its inputs are the given files by absolute
path, so it is keyed by their content: an edited file re-runs this step and what reads its output, an unchanged one
nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mergeflow.checkpoints import load_checkpoint, save_checkpoint
from mergeflow.config import Params
from mergeflow.errors import MergeflowError
from mergeflow.given_weights import read_given
from mergeflow.models import family_of
from mergeflow.objectives import get_objective
from mergeflow.seeding import derive_seed
from tasks.given_sources import given_of, given_params, provenance, resolved_source
from tasks.layout import BASE, PREPARED, TaskPaths, client_checkpoint, client_file
from tasks.prepared import read_arrays, read_info
from tasks.steps import Step

BASE_KEY = "pretrain.checkpoint"


def plan_given_clients(params: Params) -> list[Step]:
    """One step per given client (``finetune.checkpoints``, a task's ``checkpoint``), keyed by its files, its
    partition and its (task's) base model."""
    tasks = {ref.index: ref.task for ref in params.clients}
    return [
        given_client_step(params, client, key, source, tasks[client])
        for client, (key, source) in params.given_clients.items()
    ]


def given_client_step(params: Params, client: int, key: str, source: str, task: str | None = None) -> Step:
    """The step that makes client ``client`` (its global id; of ``task`` in a multi-task run) from ``source``,
    given as params ``key``."""
    given = resolved_source(key, source)
    paths = TaskPaths(task)
    return Step(
        f"finetune/client_{client:03d}",
        "tasks.given:import_client",
        {"client": client, **given_params(given), **({"task": task} if task else {})},
        inputs=(paths.base, client_file(client), paths.partitions_info, *given.files),
        members=params.model_members,
    )


def plan_given_base(params: Params) -> list[Step]:
    """With ``pretrain.checkpoint``, one step that makes it the base model (checked against the data); else none."""
    if params.pretrain.checkpoint is None or params.multitask:  # a multi-task run's pretrain step reads it
        return []
    given = resolved_source(BASE_KEY, params.pretrain.checkpoint)
    step_params = {"seed": params.seed, "model": params.section("model"), **given_params(given)}
    return [
        Step(
            "pretrain",
            "tasks.given:import_base",
            step_params,
            inputs=(f"{PREPARED}/info.json", *given.files),
            members=params.model_members,
        )
    ]


def import_client(params: dict[str, Any], root: Path, out: Path, _settings: dict[str, Any]) -> dict[str, Any]:
    """Read a given client, check it against the base model, and write it as a trained client's checkpoint."""
    client, given, paths = params["client"], given_of(params), TaskPaths(params.get("task"))
    base, base_meta = load_checkpoint(root / paths.base)
    try:
        spec, state = read_given(given, base, base_meta["spec"])
    except ValueError as error:
        raise MergeflowError(f"{given.key}: {error}") from None
    _, y = read_arrays(root / client_file(client), read_info(root, paths.partitions))
    finite = all(value.isfinite().all() for value in state.values() if value.is_floating_point())
    meta = {
        "spec": spec,
        "role": "client",
        "client": client,
        **({"task": paths.task} if paths.task else {}),
        "num_examples": len(y),
        "diverged": not finite,
        "given": provenance(given),
    } | ({} if finite else {"divergence": "non-finite weights in the given checkpoint"})
    save_checkpoint(out / client_checkpoint(client), state, meta)
    return {"num_examples": len(y), "given": given.kind, "diverged": not finite}


def import_base(params: dict[str, Any], root: Path, out: Path, _settings: dict[str, Any]) -> dict[str, Any]:
    """Check a given base against the model the params and the data describe, and write it as the base model."""
    given = given_of(params)
    info = read_info(root)
    output_dim = get_objective(info["task"]).output_dim(info)
    seed = derive_seed(params["seed"], "init")
    expected, expected_spec = family_of(params["model"]["arch"]).build_base(params["model"], info, output_dim, seed)
    try:
        spec, state = read_given(given, expected.state_dict(), expected_spec)
    except ValueError as error:
        raise MergeflowError(f"{given.key}: {error}") from None
    save_checkpoint(out / BASE, state, {"spec": spec, "role": "base", "epoch_losses": [], "given": provenance(given)})
    return {"trained": False, "given": given.kind, "language_model_losses": None}
