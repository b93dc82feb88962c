"""How the runner groups a stage's uncached steps into Prefect task runs (``orchestration.steps_per_task``).

The params only name the setting (:class:`mergeflow.config.OrchestrationConfig`); the policy that reads it,
with the times of the steps run so far, is the runner's (:func:`tasks.runner.run_stage`).
"""

from __future__ import annotations

from mergeflow.config import OrchestrationConfig

SHORT_STEP_SECONDS = 0.5  # steps shorter than this run one after another in one task run (auto)


def steps_per_task_run(orchestration: OrchestrationConfig, uncached: int, typical_seconds: float | None = None) -> int:
    """Uncached steps per Prefect task run, for a wave with ``uncached`` of them, after steps of the
    same stage that took ``typical_seconds`` each (None: none ran yet)."""
    if orchestration.steps_per_task != "auto":
        return int(orchestration.steps_per_task)
    if typical_seconds is not None and typical_seconds < SHORT_STEP_SECONDS:
        return max(1, uncached)
    workers = orchestration.max_workers if orchestration.task_runner == "threads" else orchestration.dask_workers
    return max(1, -(-uncached // workers))


def runs_waves_together(orchestration: OrchestrationConfig, typical_seconds: float | None) -> bool:
    """Whether a stage's remaining waves run as one chain in one task run: ``auto``, unless the stage's
    steps so far took ``SHORT_STEP_SECONDS`` or more each (typically). The chain stops itself once its
    steps turn out that long, so a stage of long steps runs at most one of them alone."""
    return orchestration.steps_per_task == "auto" and (typical_seconds is None or typical_seconds < SHORT_STEP_SECONDS)
