"""Atomic file writes, torch-free: a file appears whole or not at all (a kill loses no finished work).

:func:`atomic_path` writes beside the target and renames it into place; :func:`private_directory`
marks a scratch directory nobody reads until it is complete, where files are written in place.
A write that finds the disk full raises an ``OSError`` naming the file (:func:`disk_full`).
"""

from __future__ import annotations

import contextvars
import errno
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
    with _naming_a_full_disk(path):
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


# How Rust's io::Error ends its text (safetensors' SafetensorError carries no errno), and SQLite's words.
_FULL_DISK_WORDS = {errno.ENOSPC: ("(os error 28)", "database or disk is full"), errno.EDQUOT: ("(os error 122)",)}


def disk_full(error: BaseException) -> int | None:
    """``errno.ENOSPC`` or ``errno.EDQUOT`` when ``error`` says that the disk is full: an ``OSError``, or a
    library's error that carries the OS error only in its text (safetensors, SQLite); else None."""
    if isinstance(error, OSError):
        return error.errno if error.errno in _FULL_DISK_WORDS else None
    text = str(error)
    return next((code for code, words in _FULL_DISK_WORDS.items() if any(w in text for w in words)), None)


@contextmanager
def _naming_a_full_disk(path: Path) -> Iterator[None]:
    """A full disk met in the block raises ``OSError(ENOSPC or EDQUOT, ..., path)``: the file being written,
    not its temp file nor a library's error without a name."""
    try:
        yield
    except Exception as error:
        code = disk_full(error)
        if code is None:
            raise
        raise OSError(code, os.strerror(code), str(path)) from error


def write_json(path: str | Path, data: Any) -> None:
    """Write canonical, indented JSON atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
