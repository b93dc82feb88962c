"""Running the pipeline from the command line: one run per project directory at a time, recorded in
``.mergeflow/last_run.json``. A run whose every step is cached is materialised here without
importing Prefect; only a run with work to do starts the flow (:mod:`flows.pipeline`)."""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flows.dvc_lock import ParamsSource, sync_dvc_lock
from mergeflow.config import Params
from mergeflow.files import atomic_path
from tasks.run_lease import holding, new_token
from tasks.runner import cached_run
from tasks.stages import STAGES, get_stage
from tasks.store import STATE_DIR

LAST_RUN = Path(STATE_DIR) / "last_run.json"


@contextmanager
def workspace_lock(root: Path) -> Iterator[None]:
    """One pipeline run at a time per project directory.

    Runs share the content-addressed store safely, but each one materialises its outputs at
    the same paths that the other's steps read; a second run waits here, then finds the
    first one's work in the cache. The lock file says who holds it and since when (``pid``, ``started`` in
    epoch seconds): the MLflow pipeline run starts then (:func:`tasks.provenance.run_started`); and the run's
    ``token``: the steps it starts on Dask workers write only while it holds the lock (:mod:`tasks.run_lease`).
    """
    path = root / STATE_DIR / "pipeline.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as handle:  # not "w": that would empty the holder's file before the lock is ours
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"mergeflow: another run holds {path}; waiting for it", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        token = new_token()
        handle.truncate(0)
        handle.write(json.dumps({"pid": os.getpid(), "started": time.time(), "token": token}))
        handle.flush()
        try:
            with holding(root, path, token):
                yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_and_record(
    params: Params, root: Path, stages: list[str] | None = None, params_source: ParamsSource | None = None
) -> tuple[list[dict[str, Any]], float]:
    """Run the pipeline and write ``.mergeflow/last_run.json`` (each step, run or cached); also the seconds.

    A run whose every step is cached is materialised without starting Prefect (no server, no flow
    run); otherwise the flow runs. Given where the params came from (``params_source``), a completed run
    also writes the stages into ``dvc.lock`` where DVC knows those params (:mod:`flows.dvc_lock`).
    """
    with workspace_lock(root):
        started = time.perf_counter()
        selected = STAGES if stages is None else tuple(get_stage(name) for name in stages)
        cached = cached_run(selected, params, root.resolve())
        if cached is not None:
            outcomes = [asdict(outcome) for outcome in cached]
        else:
            from flows.pipeline import run_pipeline

            outcomes = run_pipeline(params, root, stages)
        elapsed = time.perf_counter() - started
        with atomic_path(root / LAST_RUN) as tmp:  # whole or not at all, on a full disk too
            tmp.write_text(json.dumps({"seconds": elapsed, "steps": outcomes}, indent=2) + "\n")
        sync_dvc_lock(root, [stage.name for stage in selected], params_source, outcomes)
    return outcomes, elapsed
