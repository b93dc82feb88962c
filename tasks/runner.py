"""Run a registry stage: plan its steps from params, execute them cached, tidy its outputs."""

from __future__ import annotations

from pathlib import Path

from prefect.logging import get_run_logger

from mergeflow.config import Params
from mergeflow.stages import Stage
from tasks.steps import StepOutcome, resolve, run_steps


def run_stage(stage: Stage, params: Params, root: Path) -> list[StepOutcome]:
    """Execute a stage's phases in order and remove stale files from its outputs."""
    from tasks.store import ArtifactStore

    log = get_run_logger()
    outcomes: list[StepOutcome] = []
    for phase in stage.phases:
        planned = resolve(phase)(params)
        # A plan is one batch of independent steps, or waves of batches run one after another
        # (federated rounds: each wave reads what the one before it wrote).
        waves = planned if planned and isinstance(planned[0], list) else [planned]
        for wave in waves:
            outcomes += run_steps(wave, root, params.orchestration.torch_threads, params.orchestration.steps_per_task)
    produced = {name for outcome in outcomes for name in outcome.files}
    for stale in ArtifactStore(root).prune_outputs(stage.produced, produced):
        log.info("removed stale output %s", stale)
    for outcome in outcomes:
        status = "cached  " if outcome.cached else f"ran {outcome.seconds:5.1f}s"
        log.info("%-12s %-32s %s", stage.name, outcome.name, status)
    return outcomes
