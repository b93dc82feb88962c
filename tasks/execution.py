"""Executing steps as Prefect task runs: one task type whose cache key is the step's content key.

Cache hits are read from mergeflow's own step records first (no task run); the misses run one per task
run, or several to a task run, each still recorded on its own as soon as it finishes; short steps
in waves (federated rounds) can run wave after wave in one task run (``execute_waves``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.settings import get_current_settings

from mergeflow import cancel
from mergeflow.files import private_directory
from mergeflow.import_graph import third_party_versions
from tasks import dask_waits
from tasks.records import cache_hit, outcome_of, write_record
from tasks.run_lease import Lease, ensure_held, held, watched
from tasks.step_devices import dask_annotation, device_record, gpu_slot
from tasks.steps import Step, StepOutcome, refuse_stale_code, resolve, step_key
from tasks.store import ArtifactStore


@task(persist_result=False, cache_policy=NO_CACHE, task_run_name="{step.name}")
def execute_step(step: Step, key: str, root: str, torch_threads: int = 1, lease: Lease | None = None) -> dict[str, Any]:
    """Run one step as its own task run and write its record under the step's key.

    ``key`` is computed by the caller (``step_key``) so that it is hashed once and reported.
    ``torch_threads`` is not part of the cache key: it changes no result. The cache is mergeflow's
    (``run_steps`` looks each step up before submitting it), not Prefect's. ``lease``: the run's hold on
    the workspace; a step on a Dask worker writes only while it holds (:mod:`tasks.run_lease`).
    """
    with watched(lease), _scratch(root) as scratch:
        outcome = _run_step(step, root, torch_threads, scratch)
        ensure_held(lease)
    return write_record(Path(root), step, key, outcome)


@task(persist_result=False, cache_policy=NO_CACHE, task_run_name="{label}")
def execute_steps(
    label: str, steps: list[Step], keys: list[str], root: str, torch_threads: int = 1, lease: Lease | None = None
) -> list[dict]:
    """Run several steps in one task run (``orchestration.steps_per_task``).

    Each step's record is written as soon as the step finishes, as ``execute_step`` writes it, so
    steps stay cached one by one and a kill mid-batch loses only the step that was running.
    """
    outcomes = []
    with watched(lease), _scratch(root) as scratch:
        for step, key in zip(steps, keys, strict=True):
            outcome = _run_step(step, root, torch_threads, scratch)
            ensure_held(lease)
            outcomes.append(write_record(Path(root), step, key, outcome))
    return outcomes


@task(persist_result=False, cache_policy=NO_CACHE, task_run_name="{label}")
def execute_waves(
    label: str,
    waves: list[list[Step]],
    root: str,
    torch_threads: int = 1,
    ran_before: list[float] | None = None,
    short_below: float | None = None,
    lease: Lease | None = None,
) -> list[dict[str, Any]]:
    """Run waves of steps one after another in one task run (short steps: :func:`tasks.scheduling.runs_waves_together`).

    A wave's keys hash what the waves before it wrote, so each step is keyed, looked up, run when
    missing, recorded and materialised in turn, here in the worker: steps stay cached, and resumed,
    one by one, as in ``execute_steps``. With ``short_below``, the chain stops after the step that
    makes the typical time of the steps run (``ran_before`` and these) reach it: the caller runs
    the rest wave by wave, in parallel. Returns the records of the steps done, with ``cached`` added.
    """
    store, lookup, code_hashes = ArtifactStore(Path(root)), _looks_up(), {}
    outcomes, ran = [], len(ran_before or [])
    # The typical time (tasks.steps.typical_seconds) of the steps run reaches short_below exactly when at most
    # half of them (ran // 2) are shorter: counted as they run, not sorted after each (chains of thousands).
    shorter = sum(seconds < short_below for seconds in ran_before or []) if short_below is not None else 0
    with watched(lease), _scratch(root) as scratch:
        for wave in waves:
            folders = set()
            for step in wave:
                key = step_key(step, Path(root), code_hashes)
                hit = cache_hit(store, step, key) if lookup else None
                if hit is not None:
                    outcome = {**hit, "cached": True}
                else:
                    outcome = _run_step(step, root, torch_threads, scratch)
                    ensure_held(lease)
                    outcome = {**write_record(Path(root), step, key, outcome), "cached": False}
                    ran += 1
                    shorter += short_below is not None and outcome["seconds"] < short_below
                    folders.update(Path(name).parent for name in outcome["files"])
                ensure_held(lease)  # a hit's outputs too: the workspace paths are the run's
                store.materialise(outcome["files"])
                outcomes.append(outcome)
                if short_below is not None and not outcome["cached"] and shorter <= ran // 2:
                    return outcomes
            _remove_empty(scratch, folders)
    return outcomes


def _remove_empty(scratch: Path, folders: set[Path]) -> None:
    """Remove a wave's own folders (a round's) from the scratch folder once empty: the next wave writes into
    new ones, and folders left behind would lengthen every later step's walk of the scratch folder."""
    for folder in sorted(folders, key=lambda f: len(f.parts), reverse=True):
        if folder.parts:
            try:
                (scratch / folder).rmdir()
            except OSError:  # not empty, or gone
                pass


def run_waves(
    waves: list[list[Step]],
    root: Path,
    torch_threads: int = 1,
    ran_before: list[float] | None = None,
    short_below: float | None = None,
) -> list[StepOutcome]:
    """Run ``waves`` in one task run (``execute_waves``) and wait; the outcomes of the steps done (all of
    them, unless ``short_below`` stopped the chain), their outputs in place."""
    steps = [step for wave in waves for step in wave]
    label = f"{steps[0].name} … {steps[-1].name} ({len(steps)} steps)"
    lease = held(root)
    with dask_annotation(steps):
        future = execute_waves.submit(label, waves, str(root), torch_threads, ran_before, short_below, lease)
    records = dask_waits.result(future, label)
    return [outcome_of(step, record, record["cached"]) for step, record in zip(steps, records, strict=False)]


def _precision(step: Step) -> str | None:
    """A training step's precision (fp32 unless set); None for steps that have no such setting."""
    return step.params["train"].get("precision", "fp32") if "train" in step.params else None


def _run_step(step: Step, root: str, torch_threads: int, scratch: Path) -> dict[str, Any]:
    """Run a step into ``scratch`` (empty, and left empty) and move its outputs into the artifact store."""
    import torch

    refuse_stale_code(step)  # a Dask worker of an earlier run may hold older code than the step was keyed by
    torch.set_num_threads(torch_threads)
    store = ArtifactStore(Path(root))
    began, started = time.time(), time.perf_counter()
    with gpu_slot(step.settings), cancel.running(step.name):
        cancel.check()  # a step about to start (the rest of a task run's steps, too) starts no more
        summary = resolve(step.fn)(step.params, Path(root), scratch, step.settings)
    files = store.ingest(scratch)
    return {
        "files": files,
        "stamps": store.stamps(files),
        "summary": summary,
        "seconds": time.perf_counter() - started,
        "started": began,  # wall clock (epoch seconds): the MLflow run of what it made starts then
        "versions": third_party_versions(),  # not in the key (as in DVC): the record says what made it
        # nor is the device (results agree across devices up to rounding): the record says which made it
        **device_record(step.settings, _precision(step)),
    }


@contextmanager
def _scratch(root: str) -> Iterator[Path]:
    """One scratch directory for the steps of a task run, one after another: each step's outputs leave
    it at ingest, its empty folders stay for the next step (they write into the same ones: creating and
    removing folders is most of a small step's file cost). Nothing reads it before a step returns, so
    its files need no temp-and-rename (``private_directory``)."""
    with ArtifactStore(Path(root)).scratch_dir() as scratch, private_directory(scratch):
        yield Path(scratch)


def _looks_up() -> bool:
    """Whether cache hits count; not under PREFECT_TASKS_REFRESH_CACHE, which forces every step to run,
    as it does for Prefect's own lookup."""
    return not get_current_settings().tasks.refresh_cache


def run_steps(
    steps: list[Step], root: Path, torch_threads: int = 1, steps_per_task: int | Callable[[int], int] = 1
) -> list[StepOutcome]:
    """Materialise cached steps; submit the others to the flow's task runner and wait.

    Uncached steps run one per task run, or ``steps_per_task`` to a task run (a number, or a
    function of how many are uncached): fewer task runs cost less orchestration when steps are
    short, while each step is still cached on its own. A cache hit whose blobs were deleted from
    the store is re-executed.
    """
    store, lookup, code_hashes = ArtifactStore(root), _looks_up(), {}
    found: dict[int, dict[str, Any]] = {}
    missing: list[tuple[int, Step, str]] = []
    for index, step in enumerate(steps):
        key = step_key(step, root, code_hashes)
        hit = cache_hit(store, step, key) if lookup else None
        if hit is not None:
            found[index] = hit
        else:
            missing.append((index, step, key))
    per_task = steps_per_task(len(missing)) if callable(steps_per_task) else steps_per_task
    pending = _submit(missing, root, torch_threads, per_task)
    outcomes = []
    for index, step in enumerate(steps):
        cached = index in found
        result = found[index] if cached else pending[index]()
        store.materialise(result["files"])
        outcomes.append(outcome_of(step, result, cached))
    return outcomes


def _submit(
    missing: list[tuple[int, Step, str]], root: Path, torch_threads: int, steps_per_task: int
) -> dict[int, Callable[[], dict[str, Any]]]:
    """Submit the uncached steps; return, per step index, a call that waits for its result."""
    pending: dict[int, Callable[[], dict[str, Any]]] = {}
    lease = held(root)
    if steps_per_task == 1:
        for index, step, key in missing:
            with dask_annotation([step]):
                future = execute_step.submit(step, key, str(root), torch_threads, lease)
            pending[index] = functools.partial(dask_waits.result, future, step.name)
        return pending
    for start in range(0, len(missing), steps_per_task):
        batch = missing[start : start + steps_per_task]
        names = [step.name for _, step, _ in batch]
        label = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]} ({len(names)} steps)"
        steps, keys = [step for _, step, _ in batch], [key for _, _, key in batch]
        with dask_annotation(steps):
            future = execute_steps.submit(label, steps, keys, str(root), torch_threads, lease)
        for position, (index, _, _) in enumerate(batch):
            pending[index] = functools.partial(_nth_result, future, label, position)
    return pending


def _nth_result(future: PrefectFuture, label: str, position: int) -> dict[str, Any]:
    return dask_waits.result(future, label)[position]
