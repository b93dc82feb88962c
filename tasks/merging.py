"""Steps of the ``merge`` stage: one cached step per merge method."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from mergeflow.checkpoints import load_checkpoint, save_checkpoint
from mergeflow.config import Params
from mergeflow.merge import METHODS, run_merge
from tasks.fisher import factors_file, fisher_file
from tasks.steps import Step
from tasks.training import BASE, client_checkpoint

MERGED = "models/merged"
_CODE = ("mergeflow/merge", "mergeflow/checkpoints.py", "tasks/merging.py")


def merged_checkpoint(method: str) -> str:
    """Relative path of one method's merged model."""
    return f"{MERGED}/{method}.safetensors"


def _inputs(method: str, clients: range) -> tuple[str, ...]:
    needs = METHODS[method].needs
    paths = [BASE, *(client_checkpoint(c) for c in clients)]
    if "fishers" in needs:
        paths += [fisher_file(c) for c in clients]
    if "factors" in needs:
        paths += [factors_file(c) for c in clients]
    return tuple(paths)


def plan_merge(params: Params) -> list[Step]:
    """One step per method, keyed by its options and only the inputs it needs."""
    clients = range(params.partition.num_clients)
    return [
        Step(
            f"merge/{method}",
            "tasks.merging:merge_clients",
            {"method": method, "options": params.merge.options.get(method, {}), "num_clients": len(clients)},
            inputs=_inputs(method, clients),
            code=_CODE,
        )
        for method in params.merge.methods
    ]


def merge_clients(params: dict[str, Any], root: Path, out: Path) -> dict[str, Any]:
    """Merge the client checkpoints with one registered method; keep its curves in the metadata."""
    method = params["method"]
    clients = range(params["num_clients"])
    needs = METHODS[method].needs
    loaded = [load_checkpoint(root / client_checkpoint(c)) for c in clients]
    base_state, base_meta = load_checkpoint(root / BASE)
    result = run_merge(
        method,
        [state for state, _ in loaded],
        base=base_state if "base" in needs else None,
        weights=[meta["num_examples"] for _, meta in loaded],
        fishers=[load_file(root / fisher_file(c)) for c in clients] if "fishers" in needs else None,
        factors=[load_file(root / factors_file(c))["U"] for c in clients] if "factors" in needs else None,
        **params["options"],
    )
    meta = {
        "spec": base_meta["spec"],
        "role": "merged",
        "method": method,
        "options": params["options"],
        "curves": result.curves,
        "summary": result.summary,
    }
    save_checkpoint(out / merged_checkpoint(method), result.state, meta)
    return {"method": method, **result.summary}
