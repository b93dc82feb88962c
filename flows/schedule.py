"""The scheduled flow that ``mergeflow serve`` deploys: each run reads the params file when it starts
and runs the pipeline as ``mergeflow run`` does (cached steps skipped, ``.mergeflow/last_run.json``)."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.runs import run_and_record
from mergeflow.config import load_params
from mergeflow.errors import MergeflowError
from mergeflow.preflight import check_model, check_paths


@flow(name="mergeflow-scheduled")
def scheduled_pipeline(params_file: str, root: str, overrides: list[str] | None = None) -> dict[str, int]:
    """Read the params file when the run starts (so edits apply to the next run) and run the pipeline."""
    params = load_params(params_file, overrides or [])
    check_paths(params, params_file)
    check_model(params, params_file)
    outcomes, _ = run_and_record(params, Path(root))
    return {"steps": len(outcomes), "ran": sum(not o["cached"] for o in outcomes)}


def serve(
    params_file: Path, overrides: list[str], root: Path, *, cron: str | None, interval: float | None, name: str
) -> None:
    """Create a deployment of the scheduled pipeline and serve it until interrupted.

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
    scheduled_pipeline.serve(name=name, cron=cron, interval=interval, parameters=parameters, limit=1)
