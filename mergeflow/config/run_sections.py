"""How a run runs and is recorded: the ``orchestration`` and ``tracking`` sections (no step's cache key)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from mergeflow.config.section import Section
from mergeflow.device import device_setting_problem


class OrchestrationConfig(Section):
    """Where per-client and per-round tasks run.

    ``threads``: a thread pool of ``max_workers`` in this process. ``dask``: a Dask cluster
    through prefect-dask: the cluster at ``dask_address`` (e.g. ``tcp://scheduler:8786``, whose
    workers must see the project directory at the same path), or a LocalCluster of
    ``dask_workers`` single-threaded processes. Every step runs torch with ``torch_threads``
    intra-op threads, whatever the runner: float reductions then add up in the same order,
    so threads and Dask give bit-identical weights. ``steps_per_task`` > 1 runs that many
    uncached steps (e.g. clients of a round) in one Prefect task run: less orchestration per
    step when steps take milliseconds, while each step is still cached, and resumed, on its own.
    ``auto`` runs a wave's uncached steps in one task run when the stage's steps so far took
    under half a second each (a federated round of small models: threads would only contend for
    the GIL), and otherwise splits them into one task run per worker (``max_workers`` threads, or
    ``dask_workers``), so the workers stay busy and a wave costs a few task runs. A stage of waves
    (federated rounds) starts as one chain of its waves in one task run, keying each wave after the
    one before it is in place, and goes on wave by wave once its steps turn out long
    (:func:`tasks.scheduling.runs_waves_together`).

    ``device``: where steps that compute (training, Fisher, alignment, merges, federated rounds,
    evaluation) run: ``auto`` (CUDA when torch sees a GPU, else the CPU), ``cpu``, ``cuda``,
    ``cuda:N`` or ``mps``. It is not part of a step's cache key (a result does not depend on the
    device beyond rounding): each step record and MLflow run notes the device that made it, and a
    run whose results come from more than one device says so. ``gpu_workers``: at most this many
    steps use the GPU at once in this process (threads); on Dask, steps that compute ask for a
    ``GPU`` worker resource when the device is a GPU (``dask worker --resources GPU=1``).

    ``dask_lost_workers_timeout``: on Dask, a run whose scheduler has had no worker for this many seconds
    while the run waits on a step stops with one line naming the scheduler (the finished steps stay cached);
    a worker that dies mid-step is replaced by its nanny and the step runs again elsewhere meanwhile.
    """

    task_runner: Literal["threads", "dask"] = "threads"
    max_workers: int = Field(1, ge=1)
    torch_threads: int = Field(1, ge=1)
    steps_per_task: int | Literal["auto"] = Field("auto")
    dask_address: str | None = None
    dask_workers: int = Field(2, ge=1)
    device: str = "auto"
    gpu_workers: int = Field(1, ge=1)
    dask_lost_workers_timeout: float = Field(60.0, gt=0)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        problem = device_setting_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("steps_per_task")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be 'auto' or at least 1")
        return value


AUTO_CLIENT_RUNS = 20  # the most clients that ``client_runs: auto`` gives a run each (every preset's, at most 20)


class TrackingConfig(Section):
    """What the tracking step logs to MLflow: the experiment, and the runs and models in it.

    ``log_models``: each merge's model is logged and registered in the Model Registry.
    ``client_runs``: which runs give each client a child run of its own: ``auto`` those with at most
    20 clients, ``all``, ``none``, or a number N: those with at most N clients. A run with more clients
    logs them in its parent run instead: each client test metric's ``_mean``, ``_std``, ``_min``,
    ``_p10``, ``_median``, ``_p90`` and ``_max`` over the clients (``clients.test_accuracy_mean``;
    likewise ``clients.num_examples_*`` and ``clients.train_loss_*``, the final training loss),
    ``clients.count`` and ``clients.diverged``, and every client's row (its metrics, size, training
    settings or given source) in the table ``clients/clients.json``. Merges and federated algorithms
    always get their runs.
    """

    experiment: str = "mergeflow"
    log_models: bool = True
    client_runs: int | Literal["auto", "all", "none"] = "auto"

    @field_validator("client_runs", mode="before")
    @classmethod
    def _client_runs(cls, value: object) -> object:
        if value in ("auto", "all", "none") or (type(value) is int and value >= 0):
            return value
        raise ValueError("must be auto, all, none or a number of clients (0 or more)")

    def logs_client_runs(self, clients: int) -> bool:
        """Whether a run of ``clients`` clients logs a child run per client."""
        if self.client_runs in ("all", "none"):
            return self.client_runs == "all"
        return clients <= (AUTO_CLIENT_RUNS if self.client_runs == "auto" else self.client_runs)
