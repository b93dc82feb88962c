"""The pipeline flow: the registry's stages in order, or a chosen subset (what ``dvc.yaml`` calls).
The scheduled flow that ``mergeflow serve`` deploys is :mod:`flows.schedule`'s."""

from __future__ import annotations

import functools
import logging
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import Flow, flow
from prefect.context import SettingsContext, get_settings_context
from prefect.logging.handlers import PrefectConsoleHandler
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, Settings
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from flows.outages import quiet_outages
from mergeflow import cancel
from mergeflow.config import OrchestrationConfig, Params, validate_params
from mergeflow.errors import MergeflowError
from tasks.dask_waits import lost_workers_timeout
from tasks.runner import run_stage, warn_mixed_devices
from tasks.stages import STAGES, get_stage
from tasks.steps import StepOutcome


@flow(name="mergeflow-pipeline")
def pipeline(params: dict[str, Any], root: str, stages: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the pipeline's stages (all of them by default) with cached, content-keyed tasks.

    SIGTERM or Ctrl-C cancels the steps running in its threads (:func:`mergeflow.cancel.stops_running_steps`)
    or on the Dask workers it started (:func:`_stop_dask_steps`).
    """
    config = validate_params(params)
    selected = STAGES if stages is None else tuple(get_stage(name) for name in stages)
    outcomes: list[StepOutcome] = []
    with cancel.stops_running_steps(), _stops_dask_steps(config.orchestration):
        for stage in selected:
            outcomes += run_stage(stage, config, Path(root))
    warn_mixed_devices(outcomes)
    return [asdict(outcome) for outcome in outcomes]


@contextmanager
def _stops_dask_steps(settings: OrchestrationConfig) -> Iterator[None]:
    """On an interrupt, stop the run's steps on Dask (:func:`_stop_dask_steps`); a wait on a cluster without
    workers gives up after ``orchestration.dask_lost_workers_timeout`` (:func:`tasks.dask_waits.result`)."""
    try:
        with lost_workers_timeout(settings.dask_lost_workers_timeout):
            yield
    except BaseException as error:
        if not isinstance(error, Exception) and settings.task_runner == "dask":
            _stop_dask_steps(settings.dask_address)
        raise


def _stop_dask_steps(address: str | None) -> None:
    """Terminate the worker processes of the ``LocalCluster`` the run started: their steps stop at once, leaving
    no output (every output is written atomically, as under ``kill -9``), and the cluster closes at once, where
    it would wait 4 s for busy workers before killing them. A cluster of your own (``address``) is left alone,
    since a stop there would reach other runs' steps: closing the client drops the run's queued steps, and its
    running ones stop within seconds of this run's end, writing nothing (:mod:`tasks.run_lease`)."""
    from distributed import default_client

    try:
        client = default_client()
    except ValueError:  # no step was submitted: no client yet
        return
    if address:
        cancel.note_cancelled(f"the steps on {address} (those running stop once this run ends)")
        return
    pids = [nanny.pid for nanny in client.cluster.workers.values() if nanny.pid]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    cancel.note_cancelled(f"the steps on its {len(pids)} Dask worker processes")


def task_runner(settings: OrchestrationConfig) -> TaskRunner:
    """The Prefect task runner the ``orchestration`` params ask for."""
    if settings.task_runner == "threads":
        return ThreadPoolTaskRunner(max_workers=settings.max_workers)
    from prefect_dask import DaskTaskRunner

    client = {"set_as_default": True}  # so that a stop finds the run's client (_stop_dask_steps)
    if settings.dask_address:
        return DaskTaskRunner(address=settings.dask_address, client_kwargs=client)
    workers = settings.dask_workers
    cluster = {"n_workers": workers, "threads_per_worker": 1, "processes": True, "dashboard_address": None}
    return DaskTaskRunner(cluster_kwargs=cluster, client_kwargs=client)


# (settings the copy was made from, the copy): copying Prefect's settings takes about 0.1 s.
_WITHOUT_HEARTBEAT: list[tuple[Settings, Settings]] = []


@contextmanager
def heartbeat_off() -> Iterator[None]:
    """Prefect's current settings with the flow-run heartbeat switched off (the copy made once per settings)."""
    context = get_settings_context()
    if not _WITHOUT_HEARTBEAT or _WITHOUT_HEARTBEAT[0][0] is not context.settings:
        update = {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
        _WITHOUT_HEARTBEAT[:] = [(context.settings, context.settings.copy_with_update(updates=update))]
    with SettingsContext(profile=context.profile, settings=_WITHOUT_HEARTBEAT[0][1]):
        yield


class _OwnErrorsOffTheConsole(logging.Filter):
    """Keeps Prefect's records of a step's ``MergeflowError`` (its traceback, the failed states it names) off
    the console, where the command line prints the error as one line; Prefect's API and UI still get them.
    So too its "Crash detected!" of a flow that SIGTERM or Ctrl-C stopped: the command line says what stopped."""

    _NAMES = tuple(cls.__name__ for cls in (MergeflowError, *MergeflowError.__subclasses__()))

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], MergeflowError):
            return False
        message = record.getMessage() if record.levelno >= logging.ERROR else ""
        if message.startswith("Crash detected!") and cancel.requested():
            return False
        return not any(f"{name}(" in message or f"{name}:" in message for name in self._NAMES)


def _own_errors_off_the_console() -> None:
    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(
            isinstance(f, _OwnErrorsOffTheConsole) for f in handler.filters
        ):
            handler.addFilter(_OwnErrorsOffTheConsole())
            quiet_outages(handler)


def run_pipeline(params: Params, root: Path, stages: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the flow with the task runner the params ask for (threads here, or a Dask cluster).

    The flow-run heartbeat is switched off: its thread is joined at exit, which adds up to a
    second to every flow. A step's ``MergeflowError`` reaches the console once, as the command line's
    one line, not also as Prefect's traceback.
    """
    _own_errors_off_the_console()
    name = "pipeline" if stages is None else "stage-" + "-".join(stages)
    configured = _configured_pipeline(params.orchestration.model_dump_json(), name)
    with heartbeat_off():
        return configured(params.model_dump(mode="json"), str(root.resolve()), stages)


@functools.lru_cache(maxsize=16)
def _configured_pipeline(orchestration: str, name: str) -> Flow:
    """The pipeline flow with its task runner and run name; made once per settings (``with_options`` takes
    about 10 ms; each flow run starts from a duplicate of the task runner, so one can serve every run)."""
    runner = task_runner(OrchestrationConfig.model_validate_json(orchestration))
    return pipeline.with_options(task_runner=runner, flow_run_name=name)
