"""A reproduction's MLflow run (experiment ``reproductions``): its settings, its results table as metrics and
a ``results.json`` artifact, and its step curves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.mlflow_logging import experiment_id, flatten, log_curves, log_params
from tasks.mlflow_store import tracking_uri


def log_reproduction(
    root: Path, name: str, settings: dict[str, Any], table: dict[str, dict], curves: dict[str, list[float]]
) -> str:
    """One MLflow run (tag ``mergeflow.kind=reproduction``) with a results table and step curves; its id."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(root))
    experiment = experiment_id(mlflow, "reproductions", root)
    tags = {"mergeflow.kind": "reproduction", "mergeflow.reproduction": name}
    with mlflow.start_run(experiment_id=experiment, run_name=name, tags=tags) as run:
        log_params(mlflow, flatten(settings))
        scalars = {
            f"{row}.{metric}".replace(" ", "_").replace("%", "pct").replace("(", "").replace(")", ""): float(value)
            for row, values in table.items()
            for metric, value in values.items()
        }
        mlflow.log_metrics(scalars)
        safe = {key.replace(" ", "_").replace("%", "pct"): values for key, values in curves.items()}
        log_curves(mlflow, safe)
        mlflow.log_dict(table, "results.json")
    return run.info.run_id
