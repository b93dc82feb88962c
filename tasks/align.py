"""Step of the ``align`` stage: permute every client to a reference model, with loss barriers.

The Fishers, Grams and factors were computed on the unaligned clients, so they are permuted here
with the same permutations as their model: every merge method then sees aligned models and
consistent curvature, whichever way ``align.method`` is set. With ``method: none`` the
outputs are the clients unchanged (identity permutations), so the merge stage always reads
``models/aligned``. Only what a merge reads is written: the statistics of
:func:`tasks.merge_statistics.statistics_read`, and the checkpoints only when ``merge.methods`` has an
entry (the loss barriers, which the evaluate stage reads, always).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from mergeflow.align import (
    align_models,
    apply_permutation,
    loss_barrier,
    make_loss_fn,
    make_metric_fn,
    permute_flat_columns,
    permute_grams,
)
from mergeflow.align.derive import model_permutation_spec
from mergeflow.align.repair import goal_statistics, repair, repair_points, unit_statistics
from mergeflow.checkpoints import load_checkpoint, save_checkpoint
from mergeflow.config import Params
from mergeflow.errors import MergeflowError
from mergeflow.files import atomic_path, write_json
from mergeflow.models import build_from_spec, parameter_names
from mergeflow.objectives import get_objective
from mergeflow.plots import plot_barriers
from tasks.layout import (
    ALIGN_METRICS,
    BARRIER_PLOT,
    PARTITIONS,
    PREPARED,
    aligned_checkpoint,
    aligned_factors,
    aligned_fisher,
    aligned_grams,
    client_checkpoint,
    client_file,
    factors_file,
    fisher_file,
    grams_file,
    statistics_files,
)
from tasks.merge_statistics import statistics_read
from tasks.prepared import read_arrays, read_info
from tasks.step_devices import device_settings, on_cpu, on_device, step_device
from tasks.steps import Step


def plan_align(params: Params) -> list[Step]:
    """One step: alignment is cheap next to training, and every client needs the reference."""
    clients = range(params.num_clients)
    statistics = statistics_read(params)
    # A multi-task run's clients have heads of their own: no path between two of them is one model's.
    barriers = not params.multitask
    inputs = [f"{PREPARED}/test.parquet", f"{PREPARED}/info.json", f"{PARTITIONS}/info.json"] if barriers else []
    for c in clients:
        inputs += [client_checkpoint(c), client_file(c), *statistics_files(statistics, c)]
    if params.align.method == "activations" and params.data.server_fraction > 0:
        inputs.append(f"{PREPARED}/server.parquet")
    step_params = {
        "align": params.align_settings.model_dump(mode="json"),
        "on_divergence": params.finetune.on_divergence,
        "num_clients": len(clients),
        "statistics": list(statistics),
        "checkpoints": bool(params.merge.methods),
        "seed": params.seed,
    }
    if not barriers:
        step_params["barriers"] = False
    return [
        Step(
            "align",
            "tasks.align:align_clients",
            step_params,
            inputs=tuple(inputs),
            settings=device_settings(params),
            members=params.model_members,
        )
    ]


def _reference(choice: int | str, sizes: list[int], diverged: list[int]) -> int:
    if choice != "largest":
        if int(choice) in diverged:
            raise MergeflowError(f"align.reference: client {choice} diverged; choose another reference")
        return int(choice)
    return int(np.argmax([-1 if c in diverged else size for c, size in enumerate(sizes)]))


def _diverged(loaded: list[tuple[dict, dict]], policy: str) -> list[int]:
    """The clients whose training diverged; an error under ``finetune.on_divergence: fail``."""
    diverged = [c for c, (_, meta) in enumerate(loaded) if meta.get("diverged")]
    if diverged and policy == "fail":
        reasons = "; ".join(f"client {c}: {loaded[c][1]['divergence']}" for c in diverged)
        raise MergeflowError(
            f"finetune.on_divergence: training diverged ({reasons}); lower the learning rate "
            "(e.g. finetune.clients.N.lr) or set finetune.on_divergence: exclude to merge without them"
        )
    if len(diverged) == len(loaded):
        raise MergeflowError("finetune.on_divergence: every client diverged; nothing is left to merge")
    return diverged


def _sample(X: np.ndarray, limit: int, seed: int, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """Up to ``limit`` rows of ``X`` (and of ``arrays``, alike) drawn without replacement with ``seed``, in
    their order; all rows when there are fewer. Splits may be stored sorted (by label, part of speech, …),
    so their first rows are no sample."""
    if limit >= len(X):
        return (X, *arrays)
    rows = np.sort(np.random.default_rng(seed).choice(len(X), size=limit, replace=False))
    return tuple(a[rows] for a in (X, *arrays))


def _matching_inputs(root: Path, info: dict[str, Any], reference: int, limit: int, seed: int) -> np.ndarray:
    server = root / PREPARED / "server.parquet"
    source = server if server.is_file() else root / client_file(reference)
    X, _ = read_arrays(source, info)
    return _sample(X, limit, seed)[0]


def _barriers(
    model, X, y, task: str, reference: dict, states: dict[int, dict], points: int, transforms: dict | None = None
) -> dict[str, Any]:
    """Each client's loss barrier to the reference, with the objective's ranking metric along the path
    (``accuracy`` for classification); ``transforms[client](state, t)`` rescales each point (REPAIR)."""
    loss, metric = make_loss_fn(model, X, y, task=task), make_metric_fn(model, X, y, task=task)
    name = get_objective(task).declaration.rank_by
    out = {}
    for client, state in states.items():
        transform = transforms[client] if transforms else None
        result = loss_barrier(loss, reference, state, n_points=points, metric_fn=metric, transform=transform)
        curve = {"barrier": result.barrier, "ts": result.ts, "losses": result.losses}
        out[f"client_{client:03d}"] = curve | {name: result.metrics}
    return out


def align_clients(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Align every client to the reference, permute the statistics a merge reads, measure barriers."""
    alignment, statistics = params["align"], params["statistics"]
    clients = range(params["num_clients"])
    loaded = [load_checkpoint(root / client_checkpoint(c)) for c in clients]
    diverged = _diverged(loaded, params["on_divergence"])
    reference = _reference(alignment["reference"], [meta["num_examples"] for _, meta in loaded], diverged)
    spec_json = loaded[reference][1]["spec"]
    device = step_device(settings)
    model = build_from_spec(spec_json).to(device)
    states = [on_device(state, device) for state, _ in loaded]  # matched and measured on the device
    names = parameter_names(spec_json)
    if alignment["method"] == "none":
        permuted, spec = _permuted, None
    else:
        permuted, spec = _aligned_permutations(params, root, model, spec_json, states, reference)
    for c, (state, meta) in enumerate(loaded):
        if params["checkpoints"]:
            save_checkpoint(out / aligned_checkpoint(c), permuted(c, state), {**meta, "aligned_to": reference})
        if "fishers" in statistics:
            _save_tensors(out / aligned_fisher(c), permuted(c, load_file(root / fisher_file(c))))
        if "grams" in statistics:
            _save_tensors(out / aligned_grams(c), permuted(c, load_file(root / grams_file(c)), grams=True))
        if "factors" in statistics:
            factors = load_file(root / factors_file(c))["U"]
            shapes = [tuple(state[n].shape) for n in names]
            _save_tensors(out / aligned_factors(c), {"U": permuted(c, factors, names, shapes)})

    report: dict[str, Any] = {"method": alignment["method"], "reference": reference, "excluded": diverged, "after": {}}
    if not params.get("barriers", True):
        report["before"] = {}
        write_json(out / ALIGN_METRICS, report)
        plot_barriers(report, out / BARRIER_PLOT)
        return {"reference": reference}
    info = read_info(root)
    X, y = read_arrays(root / PREPARED / "test.parquet", info)
    X, y = _sample(X, alignment["barrier_examples"], params["seed"], y)
    others = {c: states[c] for c in clients if c != reference and c not in diverged}
    report["before"] = _barriers(model, X, y, info["task"], states[reference], others, alignment["barrier_points"])
    if alignment["method"] != "none":
        moved = {c: permuted(c, states[c]) for c in others}
        report["after"] = _barriers(model, X, y, info["task"], states[reference], moved, alignment["barrier_points"])
    if alignment["repair"]:
        transforms = _repairs(
            root, alignment["examples"], params["seed"], model, spec, reference, states[reference], moved
        )
        curves = _barriers(model, X, y, info["task"], states[reference], moved, alignment["barrier_points"], transforms)
        report["repaired"] = curves
    write_json(out / ALIGN_METRICS, report)
    plot_barriers(report, out / BARRIER_PLOT)
    phases = [phase for phase in ("before", "after", "repaired") if phase in report]
    return {"reference": reference, **{f"barrier_{k}": _mean_barrier(report[k]) for k in phases}}


def _repairs(
    root: Path, examples: int, seed: int, model, spec, reference: int, reference_state: dict, moved: dict[int, dict]
):
    """Per client, REPAIR along its path to the reference: ``transform(state, t)`` moves every unit's mean and
    standard deviation to the interpolation of the two endpoints' own, measured on up to ``examples`` rows
    of the two clients' training data (half from each, drawn with ``seed``)."""
    points = repair_points(model, spec)
    info = read_info(root, PARTITIONS)
    half = max(1, examples // 2)
    transforms = {}
    for client, state in moved.items():
        data = np.concatenate(
            [_sample(read_arrays(root / client_file(c), info)[0], half, seed)[0] for c in (reference, client)]
        )
        ends = [unit_statistics(model, s, points, data) for s in (reference_state, state)]

        def transform(merged: dict, t: float, ends=ends, data=data) -> dict:
            return repair(model, merged, goal_statistics(ends, [1 - t, t]), points, data)

        transforms[client] = transform
    return transforms


def _permuted(
    client: int, tensors: Any, names: list[str] | None = None, shapes: list | None = None, grams: bool = False
) -> Any:
    """No alignment (``align.method: none``): every client's tensors (Fisher factors, Grams) as they are."""
    return tensors


def _aligned_permutations(
    params: dict[str, Any], root: Path, model, spec_json: dict[str, Any], states: list[dict], reference: int
):
    """Align every client to the reference; return the spec and ``permuted(client, tensors[, names, shapes])``,
    which applies that client's permutation to a state dict or Fisher (given names and shapes, to factors;
    with ``grams``, to Gram matrices)."""
    settings = params["align"]
    spec = model_permutation_spec(model, spec_json)
    info = read_info(root, PARTITIONS)
    by_activations = settings["method"] == "activations"
    inputs = _matching_inputs(root, info, reference, settings["examples"], params["seed"]) if by_activations else None
    aligned = align_models(
        spec,
        states[reference],
        states,
        method=settings["method"],
        inputs=inputs,
        model=model,
        seed=params["seed"],
        max_iter=settings["max_iter"],
        metric=settings["metric"],
    )
    perms = [p for _, p in aligned]

    def permuted(
        client: int, tensors: Any, names: list[str] | None = None, shapes: list | None = None, grams: bool = False
    ) -> Any:
        if names is not None:
            return permute_flat_columns(spec, names, shapes, tensors, perms[client])
        if grams:
            return permute_grams(spec, tensors, perms[client])
        return apply_permutation(spec, tensors, perms[client])

    return permuted, spec


def _mean_barrier(curves: dict[str, Any]) -> float | None:
    return float(np.mean([c["barrier"] for c in curves.values()])) if curves else None


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    with atomic_path(path) as tmp:
        save_file(on_cpu(tensors), str(tmp))
