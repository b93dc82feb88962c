"""Plans kept between runs, so that a fully cached run needs none of the stages' modules (nor torch).

A stage's plan (its waves of :class:`~tasks.steps.Step`) is a pure function of the params, the code
of the stage's modules, the local data files the source names (a glob may match new ones) and
MLflow's tracking URI (the track step's params hold it). :func:`plan_digest` hashes exactly those;
a plan stored under its digest is the plan those modules would compute again, step for step.
A run with any work to do plans afresh anyway (:mod:`flows.pipeline`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mergeflow.config import Params
from mergeflow.files import atomic_path
from tasks.checks import local_data_files
from tasks.stages import Stage
from tasks.steps import Step, project_root_of_code
from tasks.store import STATE_DIR, hash_paths

Plan = list[list[list[Step]]]  # per stage, its waves in phase order (a wave: steps keyed together)
_KEPT = 32  # plans kept, the most recently used


def plan_digest(stages: Sequence[Stage], params: Params) -> str:
    """What every plan of ``stages`` depends on, hashed."""
    code = sorted({path for stage in stages for path in stage.code})
    payload = {
        "stages": [stage.name for stage in stages],
        "params": params.model_dump(mode="json"),
        "code": hash_paths(project_root_of_code(), code),
        "data_files": local_data_files(params),
        "tracking_uri": os.environ.get("MLFLOW_TRACKING_URI"),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def stored_plan(root: Path, digest: str) -> Plan | None:
    """The plan stored under ``digest``, or None."""
    path = _directory(root) / f"{digest}.json"
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    os.utime(path)  # recently used: kept when older plans are dropped
    return [[[_step(step) for step in wave] for wave in stage] for stage in stored]


def _step(stored: dict[str, Any]) -> Step:
    """A step as :func:`store_plan` wrote it (JSON lists where the step has tuples)."""
    return Step(**{**stored, "inputs": tuple(stored["inputs"]), "members": tuple(stored["members"])})


def store_plan(root: Path, digest: str, plan: Plan) -> None:
    """Keep ``plan`` under ``digest`` (and only the most recently used plans)."""
    directory = _directory(root)
    with atomic_path(directory / f"{digest}.json") as tmp:
        tmp.write_text(json.dumps([[[asdict(s) for s in w] for w in stage] for stage in plan], default=str))
    for old in sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime)[:-_KEPT]:
        old.unlink(missing_ok=True)


def plan_of(
    stages: Sequence[Stage], params: Params, root: Path, plan_stage: Callable[[Stage, Params], list[list[Step]]]
) -> Plan:
    """The stages' plan: stored, or made by ``plan_stage`` (importing the stages' modules) and stored."""
    digest = plan_digest(stages, params)
    plan = stored_plan(root, digest)
    if plan is None:
        plan = [plan_stage(stage, params) for stage in stages]
        store_plan(root, digest, plan)
    return plan


def _directory(root: Path) -> Path:
    return root / STATE_DIR / "plans"
