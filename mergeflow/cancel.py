"""Stopping a run within seconds of SIGTERM or Ctrl-C: a process-wide stop request that long loops check.

A thread cannot be stopped from outside, and the pipeline's task runner waits for the steps running in its
threads before the process can exit. So the steps stop themselves: loops call :func:`check` between their
batches, tensors, rounds and steps (a flag read), which raises :class:`~mergeflow.errors.Cancelled` once
a stop was requested. The step's scratch output is then discarded and nothing of it is recorded; the steps
finished before stay cached. Free of torch and Prefect, so that any loop of the library can call it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from mergeflow.errors import Cancelled

_requested = threading.Event()
_cancelled: list[str] = []
_stopped_threads: dict[int, str] = {}  # thread -> why its steps stop (:func:`stop_thread`)


class Stopped(BaseException):
    """SIGTERM or SIGINT reached the command line's main thread (:func:`stop_on_signals`).

    A ``BaseException``, as ``KeyboardInterrupt`` is: no ``except Exception`` on its way takes it for an
    error to handle.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        """The signal's name, e.g. ``SIGTERM``."""
        return signal.Signals(self.signum).name


def request() -> None:
    """Ask every step running in this process to stop at its next :func:`check`."""
    _requested.set()


def requested() -> bool:
    """Whether a stop was requested."""
    return _requested.is_set()


def check() -> None:
    """Raise :class:`~mergeflow.errors.Cancelled` when a stop was requested; call it where a long loop iterates."""
    if _requested.is_set():
        raise Cancelled("the run was asked to stop")
    if _stopped_threads and (why := _stopped_threads.get(threading.get_ident())):
        raise Cancelled(why)


def stop_thread(thread: int, why: str) -> None:
    """Ask the step running in one thread (by its ident) to stop at its next :func:`check`, saying ``why``: a
    step whose run no longer holds its workspace (:mod:`tasks.run_lease`), where other threads' steps go on."""
    _stopped_threads[thread] = why


def resume_thread(thread: int) -> None:
    """Let the thread's next steps run (undo :func:`stop_thread`), once the stopped step has ended."""
    _stopped_threads.pop(thread, None)


@contextmanager
def running(step: str) -> Iterator[None]:
    """Run a step's code, noting the step's name (:func:`cancelled`) when a :func:`check` in it cancels it."""
    try:
        yield
    except Cancelled:
        _cancelled.append(step)
        raise


def cancelled() -> list[str]:
    """The steps of this process's run that a :func:`check` cancelled, in the order they stopped, and what
    :func:`note_cancelled` added."""
    return list(_cancelled)


def note_cancelled(what: str) -> None:
    """Note something else that the stop cancelled (:func:`cancelled`), e.g. the steps of a run's Dask workers."""
    _cancelled.append(what)


@contextmanager
def stops_running_steps() -> Iterator[None]:
    """The scope of a run's flow: an interrupt passing through it (Prefect's ``TerminationSignal`` for SIGTERM,
    ``KeyboardInterrupt``, :class:`Stopped`: any ``BaseException`` that is not an ``Exception``) requests a
    stop, before the flow's task runner waits for the steps still running in its threads.

    An ordinary step failure requests nothing: the other steps then finish and stay cached. Entering clears
    the request and the cancelled steps of an earlier run in this process.
    """
    _requested.clear()
    _cancelled.clear()
    try:
        yield
    except BaseException as error:
        if not isinstance(error, Exception):
            request()
        raise


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Inside: SIGTERM and SIGINT request a stop (:func:`request`) and raise :class:`Stopped` in the main thread.

    Prefect's flow engine puts its own SIGTERM handler in place while a flow runs, and calls this one once
    its flow has ended.
    """

    def stop(signum: int, frame: FrameType | None) -> None:
        request()
        raise Stopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
