"""Steps of the ``merge`` stage: one cached step per merge method."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mergeflow.checkpoints import load_checkpoint, save_checkpoint
from mergeflow.config import Params
from mergeflow.merge import METHODS, merge
from tasks.steps import Step
from tasks.training import BASE, client_checkpoint

MERGED = "models/merged"
_CODE = ("mergeflow/merge", "mergeflow/checkpoints.py", "tasks/merging.py")


def merged_checkpoint(method: str) -> str:
    """Relative path of one method's merged model."""
    return f"{MERGED}/{method}.safetensors"


def plan_merge(params: Params) -> list[Step]:
    """One step per method, keyed by that method's options, so changing one re-runs one."""
    clients = tuple(client_checkpoint(c) for c in range(params.partition.num_clients))
    return [
        Step(
            f"merge/{method}",
            "tasks.merging:merge_clients",
            {"method": method, "options": params.merge.options.get(method, {}), "num_clients": len(clients)},
            inputs=(BASE, *clients),
            code=_CODE,
        )
        for method in params.merge.methods
    ]


def merge_clients(params: dict[str, Any], root: Path, out: Path) -> dict[str, Any]:
    """Merge the client checkpoints with one registered method."""
    method = params["method"]
    loaded = [load_checkpoint(root / client_checkpoint(c)) for c in range(params["num_clients"])]
    states = [state for state, _ in loaded]
    needs = METHODS[method].needs
    base_state, base_meta = load_checkpoint(root / BASE)
    merged = merge(
        method,
        states,
        base=base_state if "base" in needs else None,
        weights=[meta["num_examples"] for _, meta in loaded] if "weights" in needs else None,
        **params["options"],
    )
    meta = {"spec": base_meta["spec"], "role": "merged", "method": method, "options": params["options"]}
    save_checkpoint(out / merged_checkpoint(method), merged, meta)
    return {"method": method}
