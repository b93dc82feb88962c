"""The pipeline flow: the registry's stages in order, or a chosen subset (what ``dvc.yaml`` calls)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from mergeflow.config import OrchestrationConfig, Params, validate_params
from mergeflow.stages import STAGES, get_stage
from tasks.runner import run_stage
from tasks.steps import StepOutcome


@flow(name="mergeflow-pipeline")
def pipeline(params: dict[str, Any], root: str, stages: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the pipeline's stages (all of them by default) with cached, content-keyed tasks."""
    config = validate_params(params)
    selected = STAGES if stages is None else tuple(get_stage(name) for name in stages)
    outcomes: list[StepOutcome] = []
    for stage in selected:
        outcomes += run_stage(stage, config, Path(root))
    return [asdict(outcome) for outcome in outcomes]


def task_runner(settings: OrchestrationConfig) -> TaskRunner:
    """The Prefect task runner the ``orchestration`` params ask for."""
    if settings.task_runner == "threads":
        return ThreadPoolTaskRunner(max_workers=settings.max_workers)
    from prefect_dask import DaskTaskRunner

    if settings.dask_address:
        return DaskTaskRunner(address=settings.dask_address)
    workers = settings.dask_workers
    cluster = {"n_workers": workers, "threads_per_worker": 1, "processes": True, "dashboard_address": None}
    return DaskTaskRunner(cluster_kwargs=cluster)


def run_pipeline(params: Params, root: Path, stages: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the flow with the task runner the params ask for (threads here, or a Dask cluster).

    The flow-run heartbeat is switched off: it adds about a second to every flow.
    """
    runner = task_runner(params.orchestration)
    name = "pipeline" if stages is None else "stage-" + "-".join(stages)
    configured = pipeline.with_options(task_runner=runner, flow_run_name=name)
    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        return configured(params.model_dump(mode="json"), str(root.resolve()), stages)
