"""Steps of the ``merge`` stage: one cached step per merge method."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from mergeflow.checkpoints import load_checkpoint, save_checkpoint
from mergeflow.config import Params
from mergeflow.merge import METHODS, run_merge
from mergeflow.models import is_transformer, parameter_names
from mergeflow.models.hf import save_pretrained
from tasks.align import aligned_checkpoint, aligned_factors, aligned_fisher
from tasks.data import TOKENIZER
from tasks.steps import Step
from tasks.training import BASE

MERGED = "models/merged"
_CODE = ("mergeflow/merge", "mergeflow/checkpoints.py", "mergeflow/models/hf.py", "tasks/merging.py")


def merged_checkpoint(name: str) -> str:
    """Relative path of one merge's model (``name`` is an entry of ``merge.methods``)."""
    return f"{MERGED}/{name}.safetensors"


def merged_pretrained_dir(name: str) -> str:
    """For transformers: the directory beside the checkpoint that ``from_pretrained`` reloads (weights,
    config and tokenizer)."""
    return f"{MERGED}/{name}"


def _uses_factors(method: str, params: Params) -> bool:
    return "factors" in METHODS[method].uses and params.fisher.low_rank


def _inputs(method: str, clients: range, with_factors: bool) -> tuple[str, ...]:
    paths = [BASE, *(aligned_checkpoint(c) for c in clients)]
    if "fishers" in METHODS[method].uses:
        paths += [aligned_fisher(c) for c in clients]
    if with_factors:
        paths += [aligned_factors(c) for c in clients]
    return tuple(paths)


def _merge_step(params: Params, name: str) -> Step:
    method, options = params.merge.resolve(name)
    clients = range(params.partition.num_clients)
    factors = _uses_factors(method, params)
    return Step(
        f"merge/{name}",
        "tasks.merging:merge_clients",
        {"name": name, "method": method, "options": options, "num_clients": len(clients), "factors": factors},
        inputs=_inputs(method, clients, factors) + ((TOKENIZER,) if params.model.arch == "hf" else ()),
        code=_CODE,
    )


def plan_merge(params: Params) -> list[Step]:
    """One step per entry of ``merge.methods``, keyed by its options and only the inputs it needs."""
    return [_merge_step(params, name) for name in params.merge.methods]


def merge_clients(params: dict[str, Any], root: Path, out: Path) -> dict[str, Any]:
    """Merge the aligned client checkpoints with one registered method; keep its curves in the metadata."""
    name, method = params["name"], params["method"]
    clients = range(params["num_clients"])
    uses = METHODS[method].uses
    checkpoints = [load_checkpoint(root / aligned_checkpoint(c)) for c in clients]
    excluded = [c for c, (_, meta) in enumerate(checkpoints) if meta.get("diverged")]
    clients = [c for c in clients if c not in excluded]  # finetune.on_divergence: exclude
    loaded = [checkpoints[c] for c in clients]
    base_state, base_meta = load_checkpoint(root / BASE)
    # Factor columns follow the model's parameter order; the files list tensors alphabetically.
    order = parameter_names(base_meta["spec"])
    fishers = None
    if "fishers" in uses:
        fishers = [{n: f[n] for n in order} for f in (load_file(root / aligned_fisher(c)) for c in clients)]
    result = run_merge(
        method,
        [state for state, _ in loaded],
        base=base_state if "base" in uses else None,
        weights=[meta["num_examples"] for _, meta in loaded],
        fishers=fishers,
        factors=[load_file(root / aligned_factors(c))["U"] for c in clients] if params["factors"] else None,
        **params["options"],
    )
    meta = {
        "spec": base_meta["spec"],
        "role": "merged",
        "name": name,
        "method": method,
        "options": params["options"],
        "curves": result.curves,
        "summary": result.summary,
        "excluded_clients": excluded,
    }
    save_checkpoint(out / merged_checkpoint(name), result.state, meta)
    if is_transformer(meta["spec"]):
        save_pretrained(meta["spec"], result.state, out / merged_pretrained_dir(name), root / TOKENIZER)
    return {"method": method, **result.summary}
