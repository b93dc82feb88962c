"""Environment defaults applied before Prefect, MLflow or DVC is imported.

Embedded, offline-friendly defaults: no telemetry, a patient ephemeral Prefect server on
slow machines, a quiet console. Anything the user has already set wins.
"""

from __future__ import annotations

import os

DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    # A request to a server gone is tried 3 times over about 6 s, not Prefect's 6 over about a minute:
    # the flow's end reports its state twice (completed, then failed), so a run notices a stopped server
    # in seconds (flows.outages) and still rides out a restart of a few seconds.
    "PREFECT_CLIENT_MAX_RETRIES": "2",
    "PREFECT_LOGGING_LOG_PRINTS": "true",
    # The console gets warnings and a line per stage (tasks.runner); Prefect's UI and API get every
    # log record, and .mergeflow/last_run.json every step.
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "MLFLOW_LOGGING_LEVEL": "WARNING",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Writing model shards" bars follow it too
    "FLWR_TELEMETRY_ENABLED": "0",
    "DVC_NO_ANALYTICS": "1",
    "DO_NOT_TRACK": "1",
}


def configure() -> None:
    """Set each default that is not already in the environment."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
