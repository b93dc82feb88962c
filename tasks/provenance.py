"""When and on what each output was made, from the steps' records, and when the pipeline run started: what the
tracking step's runs say about the steps they log (a cached step's run spans the step that made it, not the
logging)."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.records import results_dir
from tasks.store import STATE_DIR


def step_times(root: Path) -> dict[tuple[str, str], tuple[int, int]]:
    """When the step that made each output ran: ``{(path, sha256): (start, end)}`` in epoch milliseconds,
    from the steps' records (a record without a start time, from an older mergeflow, is left out)."""
    times = {}
    for path in results_dir(root).glob("*"):
        try:
            record = json.loads(path.read_text())
            start = int(record["started"] * 1000)
            end = start + int(record["seconds"] * 1000)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        times |= {(name, digest): (start, end) for name, digest in record.get("files", {}).items()}
    return times


def step_devices(root: Path) -> dict[tuple[str, str], dict[str, str]]:
    """What made each output: ``{(path, sha256): {"device", "device_name"[, "precision"]}}`` from the records of
    the steps that computed on a device (the device is not in the cache key: the runs say which made what)."""
    devices = {}
    for path in results_dir(root).glob("*"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or "device" not in record:
            continue
        facts = {key: str(record[key]) for key in ("device", "device_name", "precision") if key in record}
        devices |= {(name, digest): facts for name, digest in record.get("files", {}).items()}
    return devices


def run_started(root: Path) -> int | None:
    """When the pipeline run that holds the workspace lock started (epoch ms), as the lock file says; None
    when it does not say (a lock taken by an older mergeflow)."""
    try:
        return int(json.loads((root / STATE_DIR / "pipeline.lock").read_text())["started"] * 1000)
    except (OSError, ValueError, KeyError, TypeError):
        return None
