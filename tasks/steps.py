"""Cached steps: one Prefect task type whose cache key is built from content, not objects.

A step is a plain function ``fn(params, root, out) -> summary`` that reads its inputs from
the project root and writes its outputs under ``out`` with their final relative paths.
The cache key hashes the step's name, its code files, its params (canonical JSON) and the
sha256 of every input file, so it is stable across processes and machines; torch objects
never enter it. The task's persisted result is the output manifest, so a hit in a new
process re-materialises the files from the artifact store without running the step.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.futures import PrefectFuture
from prefect.settings import get_current_settings

from tasks.store import STATE_DIR, ArtifactStore, hash_paths

StepFunction = Callable[[dict[str, Any], Path, Path], dict[str, Any]]

# Bump to invalidate every cached step (e.g. after a change to the manifest format).
CACHE_VERSION = "1"


@dataclass(frozen=True)
class Step:
    """One unit of cached work: ``fn`` (as ``module:function``) on ``params`` and ``inputs``."""

    name: str
    fn: str
    params: dict[str, Any]
    inputs: tuple[str, ...] = ()
    code: tuple[str, ...] = ()


@dataclass
class StepOutcome:
    """What happened to a step: executed or served from the cache, and what it made."""

    name: str
    cached: bool
    seconds: float
    files: dict[str, str] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


def project_root_of_code() -> Path:
    """The directory that holds the ``mergeflow`` and ``tasks`` packages (code paths are relative to it)."""
    return Path(__file__).resolve().parent.parent


def step_key(step: Step, root: Path) -> str:
    """The content-addressed cache key of a step."""
    payload = {
        "version": CACHE_VERSION,
        "step": step.name,
        "fn": step.fn,
        "params": step.params,
        "code": hash_paths(project_root_of_code(), step.code),
        "inputs": hash_paths(root, step.inputs),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _record_name(step: Step, key: str) -> str:
    """The name of a step's persisted result (Prefect's cache key): readable, and unique by ``key``."""
    return f"{step.name.replace('/', '-')}-{key}"


def _cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    return _record_name(parameters["step"], parameters["key"])


def resolve(reference: str) -> StepFunction:
    """Import ``module:function``."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


@task(cache_key_fn=_cache_key, persist_result=True, result_serializer="json", task_run_name="{step.name}")
def execute_step(step: Step, key: str, root: str, torch_threads: int = 1) -> dict[str, Any]:
    """Run one step as its own task run; Prefect persists its result (the manifest) under the step's key.

    ``key`` is computed by the caller (``step_key``) so that it is hashed once and reported.
    ``torch_threads`` is not part of the cache key: it changes no result.
    """
    return _run_step(step, root, torch_threads)


@task(persist_result=False, cache_policy=NO_CACHE, task_run_name="{label}")
def execute_steps(label: str, steps: list[Step], keys: list[str], root: str, torch_threads: int = 1) -> list[dict]:
    """Run several steps in one task run (``orchestration.steps_per_task``).

    Each step's result is written to the result store as soon as the step finishes, in the same
    record ``execute_step`` would write, so steps stay cached one by one and a kill mid-batch
    loses only the step that was running.
    """
    results = _result_store(Path(root))
    outcomes = []
    for step, key in zip(steps, keys, strict=True):
        outcome = _run_step(step, root, torch_threads)
        results.write(obj=outcome, key=_record_name(step, key))
        outcomes.append(outcome)
    return outcomes


def _run_step(step: Step, root: str, torch_threads: int) -> dict[str, Any]:
    """Run a step into a scratch directory and move its outputs into the artifact store."""
    import torch

    torch.set_num_threads(torch_threads)
    store = ArtifactStore(Path(root))
    started = time.perf_counter()
    with store.scratch_dir() as scratch:
        summary = resolve(step.fn)(step.params, Path(root), Path(scratch))
        files = store.ingest(Path(scratch))
    return {"files": files, "summary": summary, "seconds": time.perf_counter() - started}


def _results_dir(root: Path) -> Path:
    return root / STATE_DIR / "results"


def _result_store(root: Path):
    """Prefect's store of the steps' persisted results (where ``execute_step`` writes them)."""
    from prefect.filesystems import LocalFileSystem
    from prefect.results import ResultStore
    from prefect.serializers import JSONSerializer

    return ResultStore(result_storage=LocalFileSystem(basepath=str(_results_dir(root))), serializer=JSONSerializer())


def _persisted_result(results, step: Step, key: str) -> dict[str, Any] | None:
    """The step's persisted result when Prefect's cache holds it, read without a task run.

    A hit then costs a file read instead of a Prefect task run (its API calls, states and
    events), which dominated re-runs of stages with many small steps (federated rounds).
    """
    try:
        return results.read(_record_name(step, key)).result
    except Exception:  # missing, or half-written by a killed run: the task runs (and rewrites it)
        return None


def read_record(root: Path, step: Step, key: str) -> dict[str, Any] | None:
    """A step's persisted result read straight from its JSON record, without Prefect; None when it is
    missing, expires, or is not the JSON record ``execute_step`` writes (the flow then decides)."""
    try:
        record = json.loads((_results_dir(root) / _record_name(step, key)).read_text())
        if record["metadata"].get("expiration") is not None or record["metadata"]["serializer"]["type"] != "json":
            return None
        result = json.loads(record["result"])
        return result if isinstance(result, dict) and isinstance(result.get("files"), dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cached_outcomes(steps: list[Step], root: Path) -> list[StepOutcome] | None:
    """The steps' outcomes when every one is a cache hit with its blobs in the store, materialised,
    without Prefect; None (nothing materialised) at the first miss."""
    store = ArtifactStore(root)
    hits = []
    for step in steps:
        hit = read_record(root, step, step_key(step, root))
        if hit is None or not store.has(hit["files"]):
            return None
        hits.append(hit)
    for hit in hits:
        store.materialise(hit["files"])
    return [
        StepOutcome(step.name, True, 0.0, hit["files"], hit["summary"]) for step, hit in zip(steps, hits, strict=True)
    ]


def run_steps(
    steps: list[Step], root: Path, torch_threads: int = 1, steps_per_task: int | Callable[[int], int] = 1
) -> list[StepOutcome]:
    """Materialise cached steps; submit the others to the flow's task runner and wait.

    Uncached steps run one per task run, or ``steps_per_task`` to a task run (a number, or a
    function of how many are uncached): fewer task runs cost less orchestration when steps are
    short, while each step is still cached on its own. A cache hit whose blobs were deleted from
    the store is re-executed.
    """
    store = ArtifactStore(root)
    # PREFECT_TASKS_REFRESH_CACHE forces every step to run, as it does for Prefect's own lookup.
    results = None if get_current_settings().tasks.refresh_cache else _result_store(root)
    found: dict[int, dict[str, Any]] = {}
    missing: list[tuple[int, Step, str]] = []
    for index, step in enumerate(steps):
        key = step_key(step, root)
        hit = None if results is None else _persisted_result(results, step, key)
        if hit is not None and store.has(hit["files"]):
            found[index] = hit
        else:  # a miss, or a hit whose blobs are gone: it runs and (over)writes its record
            missing.append((index, step, key))
    per_task = steps_per_task(len(missing)) if callable(steps_per_task) else steps_per_task
    pending = _submit(missing, root, torch_threads, per_task)
    outcomes = []
    for index, step in enumerate(steps):
        cached = index in found
        result = found[index] if cached else pending[index]()
        store.materialise(result["files"])
        seconds = 0.0 if cached else result["seconds"]
        outcomes.append(StepOutcome(step.name, cached, seconds, result["files"], result["summary"]))
    return outcomes


def _submit(
    missing: list[tuple[int, Step, str]], root: Path, torch_threads: int, steps_per_task: int
) -> dict[int, Callable[[], dict[str, Any]]]:
    """Submit the uncached steps; return, per step index, a call that waits for its result."""
    pending: dict[int, Callable[[], dict[str, Any]]] = {}
    if steps_per_task == 1:
        # The lookup in run_steps is the cache check, so the task skips Prefect's own (a
        # result-store read per step) and only writes its record; one variant for all steps
        # (``with_options`` is slow).
        runner = execute_step.with_options(result_storage=_results_dir(root), refresh_cache=True)
        for index, step, key in missing:
            pending[index] = runner.submit(step, key, str(root), torch_threads).result
        return pending
    for start in range(0, len(missing), steps_per_task):
        batch = missing[start : start + steps_per_task]
        names = [step.name for _, step, _ in batch]
        label = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]} ({len(names)} steps)"
        steps, keys = [step for _, step, _ in batch], [key for _, _, key in batch]
        future = execute_steps.submit(label, steps, keys, str(root), torch_threads)
        for position, (index, _, _) in enumerate(batch):
            pending[index] = functools.partial(_nth_result, future, position)
    return pending


def _nth_result(future: PrefectFuture, position: int) -> dict[str, Any]:
    return future.result()[position]
