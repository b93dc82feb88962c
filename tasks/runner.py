"""Run a registry stage: plan its steps from params, execute them cached, tidy its outputs; or, when
every step of a run is cached, materialise it all without Prefect (and, from a stored plan, without
importing the stages' modules: :mod:`tasks.plan_cache`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from mergeflow.config import Params
from tasks.records import cached_outcomes, write_stage_records
from tasks.stages import Stage
from tasks.steps import CodeHashes, Step, StepOutcome, resolve, typical_seconds


def _waves(planned: list) -> list[list[Step]]:
    """A plan is one batch of independent steps, or waves of batches run one after another
    (federated rounds: each wave reads what the one before it wrote)."""
    return planned if planned and isinstance(planned[0], list) else [planned]


def _prune(stage: Stage, outcomes: list[StepOutcome], root: Path) -> list[str]:
    """Remove the files under the stage's outputs that no step produced; their names.

    Every output directory is left in place, empty when no step wrote into it (a stage whose work
    nobody reads plans no step): DVC requires a stage's declared outputs to exist after it runs.
    """
    from tasks.store import ArtifactStore

    produced = {name for outcome in outcomes for name in outcome.files}
    removed = ArtifactStore(root).prune_outputs(stage.produced, produced)
    for out in stage.outs:
        (root / out).mkdir(parents=True, exist_ok=True)
    return removed


def run_stage(stage: Stage, params: Params, root: Path) -> list[StepOutcome]:
    """Execute a stage's phases in order and remove stale files from its outputs.

    Waves of short steps (``orchestration.steps_per_task: auto``) run as one chain in one task run,
    which stops once its steps turn out long; the rest then runs wave by wave, a wave's uncached
    steps split over the workers (:func:`tasks.scheduling.steps_per_task_run`).
    """
    from prefect.logging import get_run_logger

    from tasks.execution import run_steps, run_waves
    from tasks.scheduling import SHORT_STEP_SECONDS, runs_waves_together, steps_per_task_run

    log = get_run_logger()
    outcomes: list[StepOutcome] = []
    threads = params.orchestration.torch_threads
    for phase in stage.phases:
        waves = _waves(resolve(phase)(params))
        while waves:
            ran = [outcome.seconds for outcome in outcomes if not outcome.cached]
            typical = typical_seconds(ran)
            if len(waves) > 1 and runs_waves_together(params.orchestration, typical):
                done = run_waves(waves, root, threads, ran, SHORT_STEP_SECONDS)
                outcomes += done
                waves = _after(waves, len(done))
                continue

            def batch_size(uncached: int, typical: float | None = typical) -> int:
                return steps_per_task_run(params.orchestration, uncached, typical)

            outcomes += run_steps(waves[0], root, threads, batch_size)
            waves = waves[1:]
    for stale in _prune(stage, outcomes, root):
        log.info("removed stale output %s", stale)
    write_stage_records(root, stage.records, outcomes)
    # One record for the stage: a log record costs Prefect about half a millisecond, a step a few.
    lines = [
        f"{outcome.name:<32} {'cached' if outcome.cached else f'ran {outcome.seconds:5.1f}s'}" for outcome in outcomes
    ]
    log.info("%s: %d steps\n%s", stage.name, len(outcomes), "\n".join(lines))
    ran = [outcome for outcome in outcomes if not outcome.cached]
    seconds = sum(outcome.seconds for outcome in ran)
    # Written, not printed: the flow logs prints (PREFECT_LOGGING_LOG_PRINTS), and the console shows no INFO.
    sys.stderr.write(f"mergeflow: {stage.name}: {len(outcomes)} steps, {len(ran)} ran ({seconds:.1f}s)\n")
    return outcomes


def cached_run(stages: Sequence[Stage], params: Params, root: Path) -> list[StepOutcome] | None:
    """Every step's outcome when the whole run is cache hits, its outputs materialised and stale
    files pruned, with no Prefect server or task run; None at the first miss (the flow then runs,
    and finds the hits so far again)."""
    if _refresh_cache():
        return None
    from tasks.plan_cache import plan_of

    outcomes: list[StepOutcome] = []
    code_hashes: CodeHashes = {}
    for stage, waves in zip(stages, plan_of(stages, params, root, _plan_stage), strict=True):
        stage_outcomes: list[StepOutcome] = []
        for wave in waves:
            found = cached_outcomes(wave, root, code_hashes)
            if found is None:
                return None
            stage_outcomes += found
        _prune(stage, stage_outcomes, root)
        write_stage_records(root, stage.records, stage_outcomes)
        outcomes += stage_outcomes
    warn_mixed_devices(outcomes)
    return outcomes


def warn_mixed_devices(outcomes: Sequence[StepOutcome]) -> None:
    """Say once, on stderr, when the run's outcomes were made on more than one device
    (:func:`tasks.step_devices.mixed_devices_warning`)."""
    from tasks.step_devices import mixed_devices_warning

    warning = mixed_devices_warning((outcome.name, outcome.device) for outcome in outcomes)
    if warning:
        sys.stderr.write(warning + "\n")


def _plan_stage(stage: Stage, params: Params) -> list[list[Step]]:
    """A stage's waves in phase order, from its plan functions (importing the stage's modules)."""
    return [wave for phase in stage.phases for wave in _waves(resolve(phase)(params))]


def _refresh_cache() -> bool:
    """Whether Prefect is told to refresh every cache (``PREFECT_TASKS_REFRESH_CACHE``): from its settings
    when Prefect is loaded already (temporary settings in a process), else from the environment, so a
    fully cached command-line run never imports Prefect."""
    if "prefect.settings" in sys.modules:
        from prefect.settings import get_current_settings

        return bool(get_current_settings().tasks.refresh_cache)
    return os.environ.get("PREFECT_TASKS_REFRESH_CACHE", "").strip().lower() in ("1", "true", "t", "yes", "on")


def _after(waves: list[list[Step]], done: int) -> list[list[Step]]:
    """The waves without their first ``done`` steps (a wave a chain stopped in keeps the rest of its steps)."""
    rest = []
    for wave in waves:
        skipped = min(done, len(wave))
        done -= skipped
        if wave[skipped:]:
            rest.append(wave[skipped:])
    return rest
