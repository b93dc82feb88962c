"""Atomic file writes, torch-free: a file appears whole or not at all (a kill loses no finished work).

:func:`atomic_path` writes beside the target and renames it into place; :func:`private_directory`
marks a scratch directory nobody reads until it is complete, where files are written in place.
"""

from __future__ import annotations

import contextvars
import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_PRIVATE_DIRECTORIES: contextvars.ContextVar[tuple[Path, ...]] = contextvars.ContextVar("private", default=())


@contextmanager
def private_directory(path: str | Path) -> Iterator[None]:
    """Within the block (in this thread), :func:`atomic_path` writes files under ``path`` in place: a
    directory that nobody reads until it is complete (a step's scratch directory) needs no temp file.

    A half-written file is then left there when a write fails, so code in the block must let the
    exception end the block (the step fails and its scratch directory is discarded), never swallow it.
    """
    token = _PRIVATE_DIRECTORIES.set((*_PRIVATE_DIRECTORIES.get(), Path(path)))
    try:
        yield
    finally:
        _PRIVATE_DIRECTORIES.reset(token)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path beside ``path`` (not yet created: the block writes it); on success it replaces
    ``path`` in one rename.

    Under a :func:`private_directory` the path itself is yielded.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if any(path.is_relative_to(private) for private in _PRIVATE_DIRECTORIES.get()):
        yield path
        return
    # A unique name, not mkstemp: the writer creates the file (mkstemp's create, close and reopen
    # measured 20% of a small file's atomic write).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def write_json(path: str | Path, data: Any) -> None:
    """Write canonical, indented JSON atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
