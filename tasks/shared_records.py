"""Step records that travel with the data: each stage keeps its steps' records in one file that DVC
tracks as an output (``Stage.records``), so ``dvc push`` and ``dvc pull`` carry them with the outputs.

In a fresh clone after ``dvc pull`` the artifact store (``.mergeflow/store``) is empty, but the outputs
are in the workspace and the stage files hold the records that made them. :func:`adopt` serves a
step from them: when a record for the step's key is there and every file it lists is in the
workspace with the listed sha256, the files become the store's blobs and the record is written, so
the step is a cache hit; otherwise it is a miss and runs. ``git clone && dvc pull && mergeflow run``
then computes nothing; only the logging step runs, to fill the clone's own MLflow store (``Step.local``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from mergeflow.files import atomic_path
from mergeflow.stages import Stage
from tasks.steps import Step, StepOutcome, is_record, record_name, results_dir, write_record
from tasks.store import STATE_DIR, ArtifactStore, sha256_file

_LOCAL = ("stamps", "cached")  # facts of this machine's store and run, not of the step


def records_dir(root: Path) -> Path:
    """Where the stages' shared records live."""
    return root / STATE_DIR / "steps"


def write_stage_records(root: Path, stage: Stage, outcomes: list[StepOutcome]) -> None:
    """Write the records of a stage's steps into its shared file (unchanged content is left alone, so
    DVC does not hash it again). A step whose work lies in this machine's tracking store (``Step.local``) is
    left out: a clone logs to its own store, and a record from elsewhere would only change the file."""
    records = {}
    for outcome in (outcome for outcome in outcomes if outcome.shared):
        path = results_dir(root) / f"{outcome.name.replace('/', '-')}-{outcome.key}"
        record = json.loads(path.read_text())
        records[path.name] = {k: v for k, v in record.items() if k not in _LOCAL}
    text = json.dumps(records, sort_keys=True, indent=1) + "\n"
    target = root / stage.records
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
