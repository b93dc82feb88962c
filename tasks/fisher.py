"""Steps of the ``fisher`` stage: one cached step per client, computing only the statistics a merge reads.

The merge stage is the only reader of what this stage makes (federated rounds, evaluation and the
reproductions read none of it), so the statistics are those among the declared inputs of
``merge.methods``' methods (:func:`tasks.merge_statistics.statistics_read`). When no merge reads any,
the stage plans no step and leaves its output directory empty: ``dvc.yaml`` keeps the stage, DVC
accepts an empty directory as its output, and nothing is computed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import save_file

from mergeflow.checkpoints import load_model
from mergeflow.config import Params
from mergeflow.files import atomic_path
from mergeflow.fisher import diagonal_fisher, factor_rows_within, fisher_factors, fisher_sketch
from mergeflow.grams import linear_input_grams
from mergeflow.seeding import derive_seed
from tasks.layout import TaskPaths, client_checkpoint, client_file, factors_file, fisher_file, grams_file
from tasks.merge_statistics import statistics_read
from tasks.prepared import read_arrays, read_info
from tasks.step_devices import device_settings, on_cpu, step_device
from tasks.steps import Step


def plan_fisher(params: Params) -> list[Step]:
    """One step per client, keyed by its fine-tuned model and partition; none when no merge reads a statistic."""
    statistics = statistics_read(params)
    if not statistics:
        return []
    settings = {
        "fisher": params.section("fisher"),
        "noise_std": params.evaluate.noise_std,
        "seed": params.seed,
        "statistics": list(statistics),
    }
    return [
        Step(
            f"fisher/client_{ref.index:03d}",
            "tasks.fisher:client_fisher",
            {**settings, "client": ref.index, **({"task": ref.task} if ref.task else {})},
            inputs=(client_checkpoint(ref.index), client_file(ref.index), TaskPaths(ref.task).partitions_info),
            settings=device_settings(params),
            members=params.model_members,
        )
        for ref in params.clients
    ]


def _subset(n: int, size: int, seed: int) -> np.ndarray:
    if size >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))


def client_fisher(params: dict[str, Any], root: Path, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The ``statistics`` asked for: the diagonal Fisher and linear-layer input Grams on up to n_examples of
    the client's data, factors on rank_examples (or sketched within factor_memory_mb); in a multi-task run, of
    the client's own model (its own head) on its own task's data."""
    fisher, client, statistics = params["fisher"], params["client"], params["statistics"]
    info = read_info(root, TaskPaths(params.get("task")).partitions)
    X, y = read_arrays(root / client_file(client), info)
    model = load_model(root / client_checkpoint(client)).to(step_device(settings))
    seed = derive_seed(params["seed"], "fisher", client)
    common = {
        "kind": fisher["kind"],
        "task": info["task"],
        "batch_size": fisher["batch_size"],
        "noise_std": info.get("noise_std") or params["noise_std"],
        "seed": seed,
        "backend": fisher["backend"],
    }
    rows = _subset(len(y), fisher["n_examples"], seed)
    summary = {"examples": len(rows)}
    if "fishers" in statistics:
        diagonal = diagonal_fisher(model, X[rows], y[rows], **common)
        with atomic_path(out / fisher_file(client)) as tmp:
            save_file(on_cpu(diagonal), str(tmp))
    if "grams" in statistics:
        # RegMean's statistic on the same rows, scaled to the client's whole data (its weight in the merge).
        grams = linear_input_grams(model, X[rows], batch_size=fisher["batch_size"])
        with atomic_path(out / grams_file(client)) as tmp:
            save_file(on_cpu({k: v * len(y) / len(rows) for k, v in grams.items()}), str(tmp))
    if "factors" in statistics:
        factors, sketch = _factors(model, X, y, rows, fisher, common, seed)
        with atomic_path(out / factors_file(client)) as tmp:
            save_file(on_cpu({"U": factors}), str(tmp))
        summary["factor_rows"] = int(factors.shape[0])
        summary |= {f"sketch_{key}": value for key, value in sketch.items()}
    return summary


def _factors(model, X, y, rows: np.ndarray, settings: dict[str, Any], common: dict[str, Any], seed: int):
    """Per-example factors of ``rank_examples`` examples, or a sketch of the diagonal's examples within
    ``factor_memory_mb``; and the sketch's facts (rows, examples, shrinkage, trace) when sketched."""
    if settings["factor_memory_mb"] is None:
        chosen = _subset(len(y), settings["rank_examples"], seed + 1)
        return fisher_factors(model, X[chosen], y[chosen], **common), {}
    dim = sum(p.numel() for p in model.parameters())
    budget = factor_rows_within(settings["factor_memory_mb"] * 2**20, dim)
    return fisher_sketch(model, X[rows], y[rows], rows=budget, **common)
