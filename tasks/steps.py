"""Cached steps: what a step is and its content-addressed key, without Prefect.

A step is a plain function ``fn(params, root, out, settings) -> summary`` that reads its inputs from
the project root and writes its outputs under ``out`` with their final relative paths; ``params`` are
keyed, ``settings`` are not (:attr:`Step.settings`). A step that reads no settings names the argument
``_settings``. ``out`` holds no file when the step starts, but may hold folders an earlier step of its
task run made (create folders with ``exist_ok=True``).
The cache key hashes the step's name, its code (every file of this repository that its module imports,
transitively, and those of the registered members it runs, ``members``: :attr:`Step.code`), its params
(canonical JSON) and the sha256 of every input file, so it is stable across processes and machines; torch
objects never enter it, and neither do third-party versions (as in DVC; each record notes them instead).
What a step made is persisted in its record (:mod:`tasks.records`), so a hit in a new process
re-materialises the files from the artifact store without running the step.
Executing steps as Prefect task runs is :mod:`tasks.execution`'s; this module imports no
Prefect, so a fully cached run (:func:`tasks.records.cached_outcomes`) starts none of it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergeflow.errors import MergeflowError
from mergeflow.lazy_imports import closure_with_members
from tasks.store import hash_paths

StepFunction = Callable[[dict[str, Any], Path, Path, dict[str, Any]], dict[str, Any]]

# Bump to invalidate every cached step (e.g. after a change to the manifest format).
CACHE_VERSION = "1"
# When this process started keying or running steps (the CLI imports this module before any step runs, a
# Dask worker when it unpickles its first step): a code file changed after it may not be the code it runs.
_STARTED_NS = time.time_ns()


@dataclass(frozen=True)
class Step:
    """One unit of cached work: ``fn`` (as ``module:function``) on ``params`` and ``inputs``.

    ``settings`` reach ``fn`` beside the params, as its own argument, and stay out of the cache key: they
    change how a step runs (its device, whether a merge streams from the files), never what it makes.
    ``holds`` (``module:function`` of ``(root, record) -> bool``) names the check of a step whose work lies
    outside the workspace (runs in a tracking store): a record is a hit only while that work is still
    there. A ``local`` step's record stays out of the stages' shared records
    (:func:`tasks.records.write_stage_records`): its work is in a store of this machine, which a clone
    does not have.
    """

    name: str
    fn: str
    params: dict[str, Any]
    inputs: tuple[str, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)
    holds: str | None = None
    local: bool = False
    members: tuple[str, ...] = ()

    @property
    def code(self) -> tuple[str, ...]:
        """The source files that key this step: the import closure, inside this repository, of the
        module that defines ``fn`` and of each of ``members``, the modules of the registered members it
        runs (a merge method's, an algorithm's: :attr:`mergeflow.registry.Member.module`), which ``fn``
        imports by name when it runs (:func:`mergeflow.import_graph.import_closure`)."""
        return code_closure((self.fn.partition(":")[0], *self.members))


@dataclass
class StepOutcome:
    """What happened to a step: executed or served from the cache, and what it made."""

    name: str
    cached: bool
    seconds: float
    files: dict[str, str] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    key: str = ""
    device: str | None = None  # the device that made it (``tasks.step_devices.made_on``); None for no device step
    shared: bool = True  # whether its record travels with the data (not a step whose work is in a tracking store)


def project_root_of_code() -> Path:
    """The directory that holds the ``mergeflow`` and ``tasks`` packages (code paths are relative to it)."""
    return Path(__file__).resolve().parent.parent


@functools.cache
def code_closure(modules: tuple[str, ...]) -> tuple[str, ...]:
    """The sorted union of ``modules``' import closures in this repository, with the members' modules that
    their loaders import by name (:func:`mergeflow.lazy_imports.closure_with_members`)."""
    return closure_with_members(modules, project_root_of_code())


CodeHashes = dict[tuple[str, ...], dict[str, str]]
_OWN_CODE = project_root_of_code()  # the tree this process imports its steps from


def refuse_stale_code(step: Step) -> None:
    """Raise if a file of ``step``'s code changed after this process started, before it is keyed or run here.

    The process runs the modules it imported before (a Dask worker that lives across runs, those of its
    first step), so a key hashing the file as it is now would record a result under code that did not
    make it: a stale result for every later run."""
    for rel in changed_since_start(step.code)[:1]:
        started = time.strftime("%H:%M:%S", time.localtime(_STARTED_NS / 1e9))
        raise MergeflowError(
            f"{rel} changed after this process started ({started}, pid {os.getpid()}): the code it runs is "
            "older than the file its results would be keyed by. Start the run again (the steps finished so far "
            "stay cached); on a Dask cluster of your own (orchestration.dask_address), restart its workers first."
        )


def changed_since_start(code: tuple[str, ...]) -> list[str]:
    """The files of ``code`` (paths relative to the code's root) changed after this process started; none when
    this process imports its steps from another tree than the one it checks."""
    if project_root_of_code() != _OWN_CODE:
        return []
    changed = []
    for rel, path in _absolute(code):
        try:
            if os.stat(path).st_mtime_ns > _STARTED_NS:
                changed.append(rel)
        except FileNotFoundError:
            continue
    return changed


@functools.cache
def _absolute(code: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Each file of ``code`` with its absolute path, as a string: every step checks its code before it runs
    (:func:`refuse_stale_code`), and one ``os.stat`` of a string per file costs a fifth of ``Path`` calls'."""
    return tuple((rel, os.path.join(_OWN_CODE, rel)) for rel in code)


def step_key(step: Step, root: Path, code_hashes: CodeHashes | None = None) -> str:
    """The content-addressed cache key of a step.

    ``code_hashes`` memoises the code files' hashes for the steps keyed together (a wave, a chain
    of waves, a fully cached run): they are keyed against the code as it was at the first of them,
    the code the running process imported, without walking the code directories for each step.
    """
    code = None if code_hashes is None else code_hashes.get(step.code)
    if code is None:
        refuse_stale_code(step)
        code = hash_paths(project_root_of_code(), step.code)
        if code_hashes is not None:
            code_hashes[step.code] = code
    payload = {
        "version": CACHE_VERSION,
        "step": step.name,
        "fn": step.fn,
        "params": step.params,
        "code": code,
        "inputs": hash_paths(root, step.inputs),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def typical_seconds(seconds: list[float]) -> float | None:
    """The median of steps' run times (the upper one of an even count; None for none)."""
    ordered = sorted(seconds)
    return ordered[len(ordered) // 2] if ordered else None


def resolve(reference: str) -> StepFunction:
    """Import ``module:function``."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)
