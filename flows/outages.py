"""Faults of what a run stands on, each told as one line: the Prefect server gone, the disk full.

Neither is bad input (exit 2): the same command succeeds once the server answers or space is freed, so the
command line exits 1. Every step is written atomically and recorded as it finishes, so the steps finished
before the fault stay cached and the next run resumes from them.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import time
from pathlib import Path

from mergeflow.files import disk_full

KEPT = "the finished steps stay cached"


def report_outage(error: BaseException, root: Path) -> bool:
    """Print the one line for ``error`` when it is an outage (:func:`outage_line`) and, for a Prefect server
    gone, drop what Prefect still holds for it (:func:`_drop_prefect_backlog`); whether it was one."""
    line = outage_line(error, root)
    if line is None:
        return False
    if _server_error(error) is not None:
        _drop_prefect_backlog()
    print(f"mergeflow: error: {line}", file=sys.stderr)
    return True


def outage_line(error: BaseException, root: Path) -> str | None:
    """What went away, named, and what is kept; None when ``error`` (or what caused it) is no outage."""
    for cause in _chain(error):
        code = disk_full(cause)
        if code is not None:
            # An OSError names its file (atomic_path names the one it was writing); other writers' errors
            # (MLflow's SQLite) only the project directory, where every run writes.
            where = cause.filename if isinstance(cause, OSError) and cause.filename else f"under {root}"
            return f"{os.strerror(code).lower()} writing {where}; {KEPT}: free some space and run again"
    server = _server_error(error)
    if server is not None:
        return (
            f"the Prefect server at {_api_of(server)} does not answer ({server}); {KEPT}: "
            "run again once it is back, or without PREFECT_API_URL"
        )
    return None


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and the exceptions it was raised from or while handling, outermost first."""
    found: list[BaseException] = []
    while error is not None and error not in found:
        found.append(error)
        error = error.__cause__ or error.__context__
    return found


def _server_error(error: BaseException) -> BaseException | None:
    """The transport error (refused, reset, timed out) of a request to the Prefect API in ``error``'s chain; not
    one of another address (Hugging Face's hub also speaks httpx)."""
    if "httpx" not in sys.modules or "prefect" not in sys.modules:  # no request to Prefect was made
        return None
    import httpx

    found = (cause for cause in _chain(error) if isinstance(cause, httpx.TransportError) and _api_of(cause))
    return next(found, None)


def _api_of(error: BaseException) -> str | None:
    """The Prefect API's address when ``error``'s request went to it: ``PREFECT_API_URL``, or else the
    ephemeral server's (``http://127.0.0.1:PORT/api``)."""
    from prefect.settings import get_current_settings

    try:
        url = error.request.url  # httpx sets it on the errors of a request it sent
    except RuntimeError:
        return None
    configured = get_current_settings().api.url
    if configured:
        return configured if str(url).startswith(configured) else None
    ephemeral = url.host in ("127.0.0.1", "localhost") and url.path.startswith("/api/")
    return f"{url.scheme}://{url.netloc.decode()}/api" if ephemeral else None


def _drop_prefect_backlog() -> None:
    """Empty the queues of Prefect's background services (the events of the task runs, the logs for the API):
    at exit each service sends what it holds first, and with its server gone every event costs about 7 s of
    reconnection attempts, so the run's hundreds of events would hold the process for many minutes."""
    import queue

    from prefect.events.worker import EventsWorker

    for service in list(EventsWorker._instances.values()):  # every Prefect queue service (the logs' too)
        while True:
            try:
                service._queue.get_nowait()
            except queue.Empty:
                break
            service._queue.task_done()


# What Prefect's task and flow runs say of a step that met a full disk, without the exception itself.
_FULL_DISK_STATES = tuple(f"[Errno {code}]" for code in (errno.ENOSPC, errno.EDQUOT))


class _OutagesOffTheConsole(logging.Filter):
    """Keeps Prefect's tracebacks and failed states of the runs that an outage failed off the console, where the
    command line says it in one line (:func:`report_outage`); Prefect's API and UI still get them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] and outage_line(record.exc_info[1], Path.cwd()):
            return False
        message = record.getMessage() if record.levelno >= logging.ERROR else ""
        return not (message.startswith("Finished in state") and any(s in message for s in _FULL_DISK_STATES))


_WARN_EVERY = 600.0  # seconds; `mergeflow serve` lives on, and says so again for a later outage


class _EventRetriesSeldom(logging.Filter):
    """Lets through one warning in ten minutes that the events socket cannot be reached (Prefect warns once per
    event, every 7 s while the server is gone), and none of the events worker's dumps of the events it dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.warned = -_WARN_EVERY

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Service 'EventsWorker' failed to process item"):
            return False
        if message.startswith("Unable to connect to"):
            if time.monotonic() - self.warned < _WARN_EVERY:
                return False
            self.warned = time.monotonic()
        return True


def quiet_outages(console: logging.Handler) -> None:
    """Say an outage on the console once: Prefect's records of it off ``console`` (its console handler), its
    events worker's retries down to one warning, and its API log worker's failed batches not written to stderr
    (it writes them while ``logging.raiseExceptions`` is on, which the logging docs advise off in production)."""
    console.addFilter(_OutagesOffTheConsole())
    events = _EventRetriesSeldom()
    for name in ("prefect.events.clients", "prefect._internal.concurrency"):
        logging.getLogger(name).addFilter(events)
    logging.raiseExceptions = False
