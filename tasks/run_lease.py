"""A run's lease on its workspace: a step that a Dask worker runs writes its record and outputs only while the run
that started it still holds the workspace lock (:func:`flows.runs.workspace_lock`).

A step is keyed by the driver from its inputs as they were then, and reads them from the workspace as it runs.
Once its run has ended (killed, or stopped) the workspace is no longer that run's: a newer run may put other
inputs at the same paths, and a record written then would cache a result under a key that did not make it, or
outputs land at paths the newer run owns. So a step in another process than its run's (a Dask worker) checks
the lease before each write, and a watcher thread checks it every :data:`WATCH_SECONDS` while the step runs,
stopping it at its next :func:`mergeflow.cancel.check`. The lease holds while the lock file names the run's
token and a process holds the lock: a shared, non-blocking ``flock`` that succeeds means that none does (a
lock dies with its process, ``kill -9`` too). A check reads one small file (about 20 µs); steps in the run's
own process (threads) are not checked: their run holds the lock until they end.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mergeflow import cancel
from mergeflow.errors import Cancelled

WATCH_SECONDS = 1.0
_STOPPED = "stopped a step of an earlier run, writing nothing: "
_HOST = socket.gethostname()


@dataclass(frozen=True)
class Lease:
    """The lock file of a workspace and the token its run wrote there; the run's process (``pid`` on ``host``)."""

    lock: str
    token: str
    pid: int
    host: str

    def local(self) -> bool:
        """Whether this process is the run's own (its steps in threads need no check)."""
        return self.pid == os.getpid() and self.host == _HOST


_HELD: dict[str, Lease] = {}  # workspace (resolved) -> the lease this process's run holds on it


def new_token() -> str:
    """A run's token, written into the lock file it holds."""
    return secrets.token_hex(16)


@contextmanager
def holding(root: Path, lock: Path, token: str) -> Iterator[None]:
    """Inside: this process's run holds ``root``'s ``lock`` under ``token`` (:func:`held` says so to the steps it
    submits)."""
    workspace = str(root.resolve())
    _HELD[workspace] = Lease(str(lock.resolve()), token, os.getpid(), _HOST)
    try:
        yield
    finally:
        _HELD.pop(workspace, None)


def held(root: Path | str) -> Lease | None:
    """The lease this process's run holds on the workspace ``root``; None outside a command-line run."""
    return _HELD.get(str(Path(root).resolve())) if _HELD else None


def lost(lease: Lease) -> str | None:
    """Why ``lease`` no longer holds (its run ended, or a newer run holds the workspace); None while it holds."""
    try:
        fd = os.open(lease.lock, os.O_RDONLY)
    except OSError:
        return f"{lease.lock} is gone"
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # a run holds the workspace: this step's, while the file names its token
            if lease.token.encode() in os.read(fd, 4096):
                return None
            return f"a newer run holds {lease.lock}"
        return f"its run (pid {lease.pid} on {lease.host}) has ended"  # closing ``fd`` unlocks
    finally:
        os.close(fd)


def ensure_held(lease: Lease | None) -> None:
    """Raise :class:`~mergeflow.errors.Cancelled` when ``lease`` no longer holds (:func:`lost`): a step about to
    write its record or outputs writes nothing. Free in the run's own process, and without a lease."""
    if lease is None or lease.local():
        return
    why = lost(lease)
    if why is not None:
        raise Cancelled(_STOPPED + why)


_WATCHED: dict[int, Lease] = {}  # thread -> the lease of the step it runs
_WATCH_LOCK = threading.Lock()
_WATCHER: list[threading.Thread] = []


@contextmanager
def watched(lease: Lease | None) -> Iterator[None]:
    """Run a task run's steps under ``lease``: refused at once when it no longer holds, and stopped at their next
    :func:`mergeflow.cancel.check` once the watcher finds it lost. Nothing is watched in the run's own process."""
    if lease is None or lease.local():
        yield
        return
    ensure_held(lease)
    thread = threading.get_ident()
    with _WATCH_LOCK:
        _WATCHED[thread] = lease
        if not _WATCHER or not _WATCHER[0].is_alive():
            _WATCHER[:] = [threading.Thread(target=_watch, name="mergeflow-lease-watcher", daemon=True)]
            _WATCHER[0].start()
    try:
        yield
    finally:
        with _WATCH_LOCK:
            _WATCHED.pop(thread, None)
            cancel.resume_thread(thread)


def _watch() -> None:
    """Every :data:`WATCH_SECONDS`, stop the threads whose lease was lost (each lease checked once)."""
    while True:
        time.sleep(WATCH_SECONDS)
        with _WATCH_LOCK:
            watched = dict(_WATCHED)
        verdicts = {lease: lost(lease) for lease in set(watched.values())}
        with _WATCH_LOCK:  # a thread whose step ended meanwhile may run another one now: it is not stopped
            for thread, lease in watched.items():
                if verdicts[lease] is not None and _WATCHED.get(thread) is lease:
                    cancel.stop_thread(thread, _STOPPED + verdicts[lease])
