"""The scheduled flow that ``mergeflow serve`` deploys: each run reads the params file when it starts
and runs the pipeline as ``mergeflow run`` does (cached steps skipped, ``.mergeflow/last_run.json``)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runner import Runner

from flows.runs import run_and_record
from flows.summary import print_summary
from mergeflow.config import load_params
from mergeflow.errors import MergeflowError
from mergeflow.preflight import check_model, check_paths


@flow(name="mergeflow-scheduled")
def scheduled_pipeline(params_file: str, root: str, overrides: list[str] | None = None) -> dict[str, int]:
    """Read the params file when the run starts (so edits apply to the next run), run the pipeline and print
    its summary, as ``mergeflow run`` does."""
    params = load_params(params_file, overrides or [])
    check_paths(params, params_file)
    check_model(params, params_file)
    outcomes, elapsed = run_and_record(params, Path(root))
    print_summary(outcomes, elapsed)
    return {"steps": len(outcomes), "ran": sum(not o["cached"] for o in outcomes)}


def serve(
    params_file: Path, overrides: list[str], root: Path, *, cron: str | None, interval: float | None, name: str
) -> bool:
    """Create a deployment of the scheduled pipeline and serve it until interrupted; whether SIGTERM stopped it.

    Prefect's ephemeral API cannot schedule runs, so this needs a Prefect server
    (``PREFECT_API_URL``).
    """
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise MergeflowError(
            "serve: schedules need a Prefect server; run `prefect server start` and "
            "export PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    params = load_params(params_file, overrides)  # fail now, not at the first scheduled run
    check_paths(params, str(params_file))
    check_model(params, str(params_file))
    parameters = {"params_file": str(params_file.resolve()), "root": str(root.resolve()), "overrides": overrides}
    # One run at a time: a run that outlasts the interval delays the next instead of racing it
    # for the same workspace.
    runner = StoppableRunner(name=name, limit=1)
    runner.add_flow(scheduled_pipeline, name=name, cron=cron, interval=interval, parameters=parameters)
    print(f"mergeflow: serving deployment '{scheduled_pipeline.name}/{name}'; stop with Ctrl-C or SIGTERM", flush=True)
    asyncio.run(runner.start())
    return runner.terminated


class StoppableRunner(Runner):
    """Prefect's runner, stopped by SIGTERM as its own ``stop`` means to: it cancels a run in flight, pauses
    the schedule and returns from :meth:`start`.

    Prefect's handler calls ``stop()`` from inside the event loop, where it only makes a coroutine that is
    never awaited, then ``sys.exit(0)`` in the middle of the loop, which prints tracebacks while a run is in
    flight. Here the handler schedules ``astop`` on the running loop instead.
    """

    terminated = False
    """Whether SIGTERM stopped it."""
    _stopping: asyncio.Task[None] | None = None  # the loop keeps only a weak reference to a task

    def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:
        """Stop serving soon (the handler of SIGTERM that :meth:`start` installs)."""
        if self.terminated:
            return
        self.terminated = True
        logging.getLogger("prefect.runner").setLevel(logging.WARNING)  # mergeflow says it stopped, in one line
        loop = asyncio.get_running_loop()
        self._stopping = loop.create_task(self.astop())
