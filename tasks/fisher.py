"""Steps of the ``fisher`` stage: one cached step per client, computing only the statistics a merge reads.

The merge stage is the only reader of what this stage makes (federated rounds, evaluation and the
reproductions read none of it), so the statistics are those among the declared inputs of
``merge.methods``' methods (:func:`statistics_read`). When no merge reads any, the stage plans no
step and leaves its output directory empty: ``dvc.yaml`` keeps the stage, DVC accepts an empty
directory as its output, and nothing is computed.
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
from mergeflow.schema.merge import DECLARED
from mergeflow.seeding import derive_seed
from tasks.data import PARTITIONS, client_file, read_arrays, read_info
from tasks.devices import device_settings, on_cpu, step_device
from tasks.steps import Step
from tasks.training import client_checkpoint

FISHERS = "models/fishers"
# The merge inputs (``mergeflow.schema.merge.NEEDS``) this stage computes, in the order it computes them.
STATISTICS = ("fishers", "grams", "factors")


def fisher_file(client: int) -> str:
    """Relative path of one client's diagonal Fisher (safetensors, parameter names as keys)."""
    return f"{FISHERS}/client_{client:03d}.safetensors"


def grams_file(client: int) -> str:
    """Relative path of one client's Gram matrices of linear-layer inputs (keys: the layers' weights)."""
    return f"{FISHERS}/client_{client:03d}.grams.safetensors"


def factors_file(client: int) -> str:
    """Relative path of one client's Fisher factors U (key ``U``, F ≈ UᵀU)."""
    return f"{FISHERS}/client_{client:03d}.factors.safetensors"


def statistics_read(params: Params) -> tuple[str, ...]:
    """The statistics of :data:`STATISTICS` that some entry of ``merge.methods`` reads: those among its
    method's declared inputs (``uses``, the optional ones included, since the merge stage passes them
    when it has them); factors only with ``fisher.low_rank``, as the merge stage reads them."""
    read: set[str] = set()
    for name in params.merge.methods:
        method, _ = params.merge.resolve(name)
        read |= DECLARED[method].uses
    if not params.fisher.low_rank:
        read.discard("factors")
    return tuple(statistic for statistic in STATISTICS if statistic in read)


def statistics_files(statistics: tuple[str, ...], client: int) -> list[str]:
    """Relative paths of one client's files of those statistics."""
    paths = {"fishers": fisher_file, "grams": grams_file, "factors": factors_file}
    return [paths[statistic](client) for statistic in statistics]


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
            f"fisher/client_{client:03d}",
            "tasks.fisher:client_fisher",
            {**settings, "client": client},
            inputs=(client_checkpoint(client), client_file(client), f"{PARTITIONS}/info.json"),
            settings=device_settings(params),
        )
        for client in range(params.partition.num_clients)
    ]


def _subset(n: int, size: int, seed: int) -> np.ndarray:
    if size >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))


def client_fisher(params: dict[str, Any], root: Path, out: Path) -> dict[str, Any]:
    """The ``statistics`` asked for: the diagonal Fisher and linear-layer input Grams on up to n_examples of
    the client's data, factors on rank_examples (or sketched within factor_memory_mb)."""
    settings, client, statistics = params["fisher"], params["client"], params["statistics"]
    info = read_info(root, PARTITIONS)
    X, y = read_arrays(root / client_file(client), info)
    model = load_model(root / client_checkpoint(client)).to(step_device(params))
    seed = derive_seed(params["seed"], "fisher", client)
    common = {
        "kind": settings["kind"],
        "task": info["task"],
        "batch_size": settings["batch_size"],
        "noise_std": info.get("noise_std") or params["noise_std"],
        "seed": seed,
        "backend": settings["backend"],
    }
    rows = _subset(len(y), settings["n_examples"], seed)
    summary = {"examples": len(rows)}
    if "fishers" in statistics:
        diagonal = diagonal_fisher(model, X[rows], y[rows], **common)
        with atomic_path(out / fisher_file(client)) as tmp:
            save_file(on_cpu(diagonal), str(tmp))
    if "grams" in statistics:
        # RegMean's statistic on the same rows, scaled to the client's whole data (its weight in the merge).
        grams = linear_input_grams(model, X[rows], batch_size=settings["batch_size"])
        with atomic_path(out / grams_file(client)) as tmp:
            save_file(on_cpu({k: v * len(y) / len(rows) for k, v in grams.items()}), str(tmp))
    if "factors" in statistics:
        factors, sketch = _factors(model, X, y, rows, settings, common, seed)
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
