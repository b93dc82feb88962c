"""``dvc.lock`` after ``mergeflow run``: the stages it ran or served, committed as ``dvc commit`` would.

``dvc repro`` writes the lock after each stage it runs; ``mergeflow run`` runs the same stages in one
process, so without this ``dvc status`` would list every stage as changed and ``dvc push`` would have
nothing to push. DVC only knows the params of ``dvc.yaml``'s params file, so a run of other params (``-S``
overrides, ``--params`` another file) leaves the lock alone and says so in one line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergeflow.files import atomic_path
from tasks.stages import STAGE_NAMES
from tasks.store import STATE_DIR, sha256_file

PIPELINE = "dvc.yaml"  # generated from the stage registry (tasks.dvcfile)
PARAMS_FILE = "params.yaml"  # the file its stages read their params from (DVC's default)
LOCK = "dvc.lock"
SYNCED = Path(STATE_DIR) / "dvc_lock.json"  # what the lock was last written for, and the lock it wrote


@dataclass(frozen=True)
class ParamsSource:
    """Where a run's params came from: the params file (relative to the project root, or absolute), the
    ``-S`` overrides, and the file's sha256 when it was read (None: not known)."""

    file: str
    overrides: tuple[str, ...] = ()
    digest: str | None = None


def is_dvc_repo(root: Path) -> bool:
    """Whether ``root`` is a DVC project with a pipeline: ``.dvc/`` and ``dvc.yaml``."""
    return (root / ".dvc").is_dir() and (root / PIPELINE).is_file()


def untracked_reason(source: ParamsSource, root: Path) -> str | None:
    """Why DVC would not know the run's params, or None when they are the root's params file as it is."""
    if source.overrides:
        return "DVC does not know the -S overrides (use `dvc exp run -S …` to track them)"
    if (root / source.file).resolve() != (root / PARAMS_FILE).resolve():
        return f"DVC reads {PARAMS_FILE}, not {source.file} (use `dvc exp run -S …` to track other params)"
    if source.digest is not None and sha256_file(root / PARAMS_FILE) != source.digest:
        return f"{PARAMS_FILE} changed during the run: its outputs are of the params it read (run again)"
    return None


def changed_code(stages: Sequence[str]) -> list[str]:
    """The stages' code files changed during the run: DVC would hash them against outputs older code made."""
    from tasks.stages import get_stage
    from tasks.steps import changed_since_start

    return changed_since_start(tuple(sorted({rel for name in stages for rel in get_stage(name).code})))


def commit_stages(root: Path, stages: Sequence[str]) -> None:
    """``dvc commit --force --no-relink STAGE…``: hash each stage's deps, params and outputs into
    ``dvc.lock`` and copy the outputs into DVC's cache (what ``dvc push`` sends).

    No relink: DVC would replace each output with a copy of its cache file, which costs a write of every
    output and breaks its hard link to mergeflow's own store.
    """
    from dvc.repo import Repo

    # One target per call, and each call parses and rewrites the whole lock: the pipeline file as the
    # target does every stage in one pass (the default run's: 3 s, against 18 s stage by stage, on two busy cores).
    targets = [PIPELINE] if set(stages) == set(STAGE_NAMES) else [f"{PIPELINE}:{name}" for name in stages]
    quiet = _EmptyOutputs()
    logging.getLogger("dvc.output").addFilter(quiet)
    try:
        with Repo(str(root)) as repo:
            for target in targets:
                repo.commit(target, force=True, relink=False)
    finally:
        logging.getLogger("dvc.output").removeFilter(quiet)


class _EmptyOutputs(logging.Filter):
    """Drops DVC's warning that an output directory is empty: a stage's outputs may be empty by design (a
    single-task run's per-task metrics, the Fisher stage's when no merge reads a statistic), and DVC records
    them as such."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().endswith("is empty.")


def sync_dvc_lock(
    root: Path, stages: Sequence[str], source: ParamsSource | None, outcomes: Sequence[dict[str, Any]] = ()
) -> None:
    """After a completed run: commit ``stages`` to ``dvc.lock`` where ``root`` is a DVC project and the
    params are its params file as it is; otherwise one line on stderr saying why the lock was left alone.

    ``source`` None (one stage, as ``dvc repro`` runs it and then locks it itself; a run from Python)
    leaves DVC alone, silently. A run whose ``outcomes`` (the steps' keys and files), pipeline, params
    and lock are those the lock was last written for skips DVC altogether: a no-op run stays a fraction
    of a second instead of the seconds DVC takes to hash every output again.
    """
    if source is None or not is_dvc_repo(root):
        return
    reason = untracked_reason(source, root)
    if reason is None and (changed := changed_code(stages)):
        reason = f"{changed[0]} changed during the run: its outputs are of the code it started with (run again)"
    if reason is None:
        synced = _fingerprint(root, stages, outcomes)
        if _last_synced(root) == synced:
            return
        from dvc.exceptions import DvcException

        try:
            commit_stages(root, stages)
        except DvcException as error:  # the run itself succeeded: its outputs stay, only the lock lags
            reason = f"{error} (`dvc commit` writes it once DVC can)"
        else:
            _remember_synced(root, synced)
    if reason is not None:
        print(f"mergeflow: dvc.lock not updated: {reason}", file=sys.stderr, flush=True)


def _fingerprint(root: Path, stages: Sequence[str], outcomes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What a lock written now would be written for: the stages, each step's key and files, and the
    pipeline and params files' content (the lock's own digest is added once it is written)."""
    steps = sorted((o["name"], o.get("key", ""), sorted(o.get("files", {}).items())) for o in outcomes)
    files = {name: sha256_file(root / name) for name in (PIPELINE, PARAMS_FILE)}
    return {"stages": sorted(stages), "steps": hashlib.sha256(json.dumps(steps).encode()).hexdigest(), **files}


def _last_synced(root: Path) -> dict[str, Any] | None:
    """The fingerprint of the last lock written, with the lock as it is now (None when unknown or gone)."""
    try:
        synced = json.loads((root / SYNCED).read_text())
        written = synced.pop("lock")
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    lock = root / LOCK
    return synced if lock.is_file() and sha256_file(lock) == written else None


def _remember_synced(root: Path, synced: dict[str, Any]) -> None:
    with atomic_path(root / SYNCED) as tmp:
        tmp.write_text(json.dumps({**synced, "lock": sha256_file(root / LOCK)}))
