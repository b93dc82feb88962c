"""MLflow logging shared by the tracking step and the reproductions' runs: an experiment that MLflow's UI opens
on its runs, nested params as flat keys in batches MLflow accepts, and step-wise curves. ``mlflow`` is the
imported module, passed in: importing this module imports no MLflow."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

# Marks an experiment as model training, so that MLflow's UI opens it on its runs, not on the GenAI overview.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
_MAX_PARAMS_PER_CALL = 100


def experiment_id(mlflow: Any, name: str, root: Path) -> str:
    """The id of experiment ``name``, made if missing (its artifacts under ``root/mlruns`` for the local store);
    an existing one made without :data:`EXPERIMENT_KIND` gains it."""
    experiment = mlflow.get_experiment_by_name(name)
    if experiment is None:
        location = (root / "mlruns").resolve().as_uri() if "MLFLOW_TRACKING_URI" not in os.environ else None
        return mlflow.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
    for key, value in EXPERIMENT_KIND.items():
        if key not in experiment.tags:  # made by an older mergeflow, or by hand
            mlflow.tracking.MlflowClient().set_experiment_tag(experiment.experiment_id, key, value)
    return experiment.experiment_id


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested params as ``a.b.c`` keys with string values, for ``log_params``."""
    flat: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = json.dumps(value) if not isinstance(value, str) else value
    return flat


def log_params(mlflow: Any, params: dict[str, str]) -> None:
    """Log flat ``params`` to the active run, in batches of the size MLflow accepts in one call."""
    items = list(params.items())
    for start in range(0, len(items), _MAX_PARAMS_PER_CALL):
        mlflow.log_params(dict(items[start : start + _MAX_PARAMS_PER_CALL]))


def log_curves(mlflow: Any, curves: dict[str, list[float]]) -> None:
    """Step-wise metrics (a loss curve, a solver's residuals) in one batch, ``step`` = the index."""
    log_batch(mlflow, curves=curves)


def log_batch(
    mlflow: Any,
    params: dict[str, str] | None = None,
    metrics: dict[str, float] | None = None,
    curves: dict[str, list[float]] | None = None,
) -> None:
    """Flat ``params``, ``metrics`` (at step 0, as ``log_metrics`` logs them) and step-wise ``curves`` to the
    active run in one call: one store commit where a call each would take three (a thousand client runs)."""
    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    history = [Metric(name, float(value), now, 0) for name, value in (metrics or {}).items()]
    history += [
        Metric(name, float(v), 0, step) for name, values in (curves or {}).items() for step, v in enumerate(values)
    ]
    logged = [Param(name, value) for name, value in (params or {}).items()]
    if history or logged:
        mlflow.tracking.MlflowClient().log_batch(mlflow.active_run().info.run_id, metrics=history, params=logged)
