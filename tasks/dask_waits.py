"""Waiting for a task run on Dask: a cluster that has lost every worker, or a step that its workers died
running, ends the wait with one line instead of a wait for ever or Dask's traceback.

Dask reschedules a step whose worker died onto another worker (a nanny restarts the dead one), until
``distributed.scheduler.allowed-failures`` (default 3) workers died running it: then the step fails with
``KilledWorker``. A scheduler with no worker left holds its tasks until one comes, for ever: the driver
gives up once there was none for ``orchestration.dask_lost_workers_timeout`` seconds.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect.futures import PrefectFuture

from mergeflow.errors import Outage

POLL_SECONDS = 1.0
_TIMEOUT: list[float] = [60.0]  # orchestration.dask_lost_workers_timeout of the flow running in this process


@contextmanager
def lost_workers_timeout(seconds: float) -> Iterator[None]:
    """Inside: a wait gives up after ``seconds`` without a worker (:func:`result`)."""
    before, _TIMEOUT[0] = _TIMEOUT[0], seconds
    try:
        yield
    finally:
        _TIMEOUT[0] = before


def result(future: PrefectFuture, label: str) -> Any:
    """``future``'s result; on Dask, :class:`~mergeflow.errors.Outage` naming the step ``label`` and the
    scheduler when its workers kept dying under it or none was left (see the module)."""
    if "prefect_dask" not in sys.modules:  # threads: nothing imported Dask
        return future.result()
    from distributed import TimeoutError, wait
    from distributed.scheduler import KilledWorker
    from prefect_dask.task_runners import PrefectDaskFuture

    if not isinstance(future, PrefectDaskFuture):
        return future.result()
    dask_future = future.wrapped_future
    address = dask_future.client.scheduler.address
    without_workers = None
    while not dask_future.done():
        try:
            wait(dask_future, timeout=POLL_SECONDS)
            break
        except TimeoutError:
            pass
        if dask_future.client.nthreads():
            without_workers = None
        elif without_workers is None:
            without_workers = time.monotonic()
        elif time.monotonic() - without_workers >= _TIMEOUT[0]:
            raise Outage(
                f"no Dask worker is left on {address} (none for {_TIMEOUT[0]:g} s: "
                f"orchestration.dask_lost_workers_timeout) while {label} waited; the finished steps stay cached: "
                f"start workers (dask worker {address}) and run again"
            )
    try:
        return future.result()
    except KilledWorker as error:
        died = error.allowed_failures + 1
        raise Outage(
            f"{label}: {died} Dask worker{'s' if died > 1 else ''} of {address} died running it (the last "
            f"{error.last_worker.address}; distributed.scheduler.allowed-failures is {error.allowed_failures}): "
            "see their logs (out of memory?); the finished steps stay cached"
        ) from None
