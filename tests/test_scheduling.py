"""The runner's grouping of uncached steps into task runs (``orchestration.steps_per_task``)."""

from mergeflow.config import OrchestrationConfig
from tasks.scheduling import runs_waves_together, steps_per_task_run


def test_auto_batches_short_steps_and_spreads_long_ones_over_the_workers():
    assert steps_per_task_run(OrchestrationConfig(max_workers=2), 10) == 5
    assert steps_per_task_run(OrchestrationConfig(max_workers=4), 10) == 3  # 4 task runs: 3, 3, 3, 1
    assert steps_per_task_run(OrchestrationConfig(max_workers=4), 1) == 1
    assert steps_per_task_run(OrchestrationConfig(task_runner="dask", max_workers=1, dask_workers=5), 10) == 2
    assert steps_per_task_run(OrchestrationConfig(max_workers=4, steps_per_task=3), 10) == 3
    assert (
        steps_per_task_run(OrchestrationConfig(max_workers=4), 10, typical_seconds=0.02) == 10
    )  # short steps: one task run
    assert steps_per_task_run(OrchestrationConfig(max_workers=4), 10, typical_seconds=3.0) == 3
    assert steps_per_task_run(OrchestrationConfig(max_workers=4, steps_per_task=1), 10, typical_seconds=0.02) == 1
    # a stage's waves run as one chain in one task run unless its steps are long, under auto only
    assert runs_waves_together(OrchestrationConfig(), 0.02) and runs_waves_together(OrchestrationConfig(), None)
    assert not runs_waves_together(OrchestrationConfig(), 3.0)
    assert not runs_waves_together(OrchestrationConfig(steps_per_task=10), 0.02)
