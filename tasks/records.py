"""Step records: what each step made, persisted under its key, and served back as cache hits.

A step's record (:func:`write_record`, in ``.mergeflow/results``) holds its output manifest, so a hit in
a new process re-materialises the files from the artifact store without running the step
(:func:`cache_hit`, :func:`cached_outcomes`). The record is mergeflow's own JSON, not Prefect's result
record: Prefect orchestrates and shows the runs, and an upgrade of its result format cannot turn every
cache hit into a miss.

Records also travel with the data: each stage keeps its steps' records in one file that DVC tracks as
an output (``Stage.records``, :func:`write_stage_records`), so ``dvc push`` and ``dvc pull`` carry them
with the outputs. In a fresh clone after ``dvc pull`` the artifact store (``.mergeflow/store``) is empty,
but the outputs are in the workspace and the stage files hold the records that made them. :func:`adopt`
serves a step from them: when a record for the step's key is there and every file it lists is in the
workspace with the listed sha256, the files become the store's blobs and the record is written, so the
step is a cache hit; otherwise it is a miss and runs. ``git clone && dvc pull && mergeflow run`` then
computes nothing; only the logging step runs, to fill the clone's own MLflow store (``Step.local``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from mergeflow.files import atomic_path
from tasks.step_devices import made_on, uses_device
from tasks.steps import CodeHashes, Step, StepOutcome, resolve, step_key
from tasks.store import STATE_DIR, ArtifactStore, sha256_file

RECORD_FORMAT = "mergeflow-step-record/1"
_LOCAL = ("stamps", "cached")  # facts of this machine's store and run, not of the step


def results_dir(root: Path) -> Path:
    """Where the steps' records live (one JSON file per step and key)."""
    return root / STATE_DIR / "results"


def record_name(step: Step | StepOutcome, key: str) -> str:
    """The file name of a step's record: readable, and unique by ``key``."""
    return f"{step.name.replace('/', '-')}-{key}"


def write_record(root: Path, step: Step, key: str, outcome: dict[str, Any]) -> dict[str, Any]:
    """Persist a step's outcome (its files, their stamps, its summary, seconds and package versions);
    the record, as :func:`read_record` reads it back."""
    path = results_dir(root) / record_name(step, key)
    record = {"format": RECORD_FORMAT, "step": step.name, "key": key, **outcome}
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(record, sort_keys=True))
    return record


def read_record(root: Path, step: Step, key: str) -> dict[str, Any] | None:
    """A step's record as :func:`write_record` wrote it, or as a stage's shared records hold it with its
    outputs in the workspace (:func:`adopt`); None when there is neither."""
    try:
        record = json.loads((results_dir(root) / record_name(step, key)).read_text())
    except (OSError, ValueError):
        return adopt(root, step, key)
    return record if is_record(record, key) else None


def is_record(record: Any, key: str) -> bool:
    """Whether ``record`` is a step record of this format for ``key``."""
    valid = isinstance(record, dict) and record.get("format") == RECORD_FORMAT and record.get("key") == key
    return valid and isinstance(record.get("files"), dict)


def still_holds(step: Step, root: Path, record: dict[str, Any]) -> bool:
    """Whether the work that ``record`` says ``step`` did outside the workspace is still there (:attr:`Step.holds`)."""
    return step.holds is None or bool(resolve(step.holds)(root, record))


def cache_hit(store: ArtifactStore, step: Step, key: str) -> dict[str, Any] | None:
    """The step's record when it is a hit: its blobs all in the store and its outside work still there
    (:func:`still_holds`); None for a miss (the step then runs and rewrites its record)."""
    hit = read_record(store.root, step, key)
    if hit is None or not store.has(hit["files"], hit.get("stamps")) or not still_holds(step, store.root, hit):
        return None
    return hit


def outcome_of(step: Step, record: dict[str, Any], cached: bool) -> StepOutcome:
    """What ``record`` says happened to ``step``: served from the cache (no time spent) or run."""
    device = made_on(record) or ("cpu" if uses_device(step.settings) else None)
    seconds = 0.0 if cached else record["seconds"]
    return StepOutcome(
        step.name, cached, seconds, record["files"], record["summary"], record["key"], device, not step.local
    )


def cached_outcomes(steps: list[Step], root: Path, code_hashes: CodeHashes | None = None) -> list[StepOutcome] | None:
    """The steps' outcomes when every one is a cache hit (:func:`cache_hit`), materialised, without Prefect;
    None (nothing materialised) at the first miss. ``code_hashes``: as for :func:`tasks.steps.step_key`."""
    store = ArtifactStore(root)
    hits = []
    for step in steps:
        hit = cache_hit(store, step, step_key(step, root, code_hashes))
        if hit is None:
            return None
        hits.append(hit)
    for hit in hits:
        store.materialise(hit["files"])
    return [outcome_of(step, hit, cached=True) for step, hit in zip(steps, hits, strict=True)]


def records_dir(root: Path) -> Path:
    """Where the stages' shared records live."""
    return root / STATE_DIR / "steps"


def write_stage_records(root: Path, records_file: str, outcomes: list[StepOutcome]) -> None:
    """Write the records of a stage's steps into its shared file, ``records_file`` (``Stage.records``, relative
    to ``root``: this module does not import the stage registry, which is then no step's code). Unchanged
    content is left alone, so DVC does not hash it again. A step whose work lies in this machine's tracking
    store (``Step.local``) is left out: a clone logs to its own store, and a record from elsewhere would only
    change the file."""
    records = {}
    for outcome in (outcome for outcome in outcomes if outcome.shared):
        path = results_dir(root) / record_name(outcome, outcome.key)
        record = json.loads(path.read_text())
        records[path.name] = {k: v for k, v in record.items() if k not in _LOCAL}
    text = json.dumps(records, sort_keys=True, indent=1) + "\n"
    target = root / records_file
    if target.is_file() and target.read_text() == text:
        return
    with atomic_path(target) as tmp:
        tmp.write_text(text)


def adopt(root: Path, step: Step, key: str) -> dict[str, Any] | None:
    """The step's record from the shared files when its outputs are in the workspace as recorded (their
    files then become the store's blobs, and the record this machine's own); None otherwise."""
    shared = _shared(root).get(record_name(step, key))
    if not is_record(shared, key):
        return None
    for relative, digest in shared["files"].items():
        path = root / relative
        if not path.is_file() or sha256_file(path) != digest:
            return None
    store = ArtifactStore(root)
    for relative, digest in shared["files"].items():
        blob = store.blob(digest)
        if not blob.exists():
            blob.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(blob) as tmp:
                shutil.copyfile(root / relative, tmp)
                os.chmod(tmp, 0o444)
    return write_record(root, step, key, {**shared, "stamps": store.stamps(shared["files"])})


def _shared(root: Path) -> dict[str, Any]:
    """Every stage's shared records by record name (the files are read once per process)."""
    directory = records_dir(root)
    signature = tuple(sorted((p.name, p.stat().st_mtime_ns) for p in directory.glob("*.json")))
    cached = _CACHE.get(directory)
    if cached is None or cached[0] != signature:
        records: dict[str, Any] = {}
        for path in sorted(directory.glob("*.json")):
            try:
                records |= json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        cached = _CACHE[directory] = (signature, records)
    return cached[1]


_CACHE: dict[Path, tuple[tuple, dict[str, Any]]] = {}
