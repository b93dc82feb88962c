"""A pipeline run's clients logged in its parent run, for a run with more clients than ``tracking.client_runs``
gives a child run each: their metrics aggregated over the clients, and one table with every client's row.

A thousand child runs take minutes to log and bury the runs table; the aggregates put the clients beside the merges
in the runs table's columns, and the table (an MLflow table artifact: the UI shows it paged and sortable, and
``mlflow.load_table`` reads it back) holds what each client's run would have."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mergeflow.checkpoints import load_checkpoint_meta
from tasks.layout import client_checkpoint
from tasks.model_runs import client_params, test_metrics

CLIENT_TABLE = "clients/clients.json"
# The statistics of each client metric, as ``clients.<metric>_<statistic>``: quantiles by name.
_QUANTILES = {"min": 0.0, "p10": 0.1, "median": 0.5, "p90": 0.9, "max": 1.0}


def client_row(root: Path, client: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """What a client's run logs, as one row: ``client`` (and ``task`` in a multi-task run), ``num_examples``,
    ``diverged``, ``train_loss`` (its training's last), its test metrics, its training settings or given source."""
    meta = load_checkpoint_meta(root / client_checkpoint(client))
    row: dict[str, Any] = {"client": client}
    if meta.get("task") is not None:
        row["task"] = meta["task"]
    row |= {"num_examples": int(meta["num_examples"]), "diverged": bool(meta.get("diverged"))}
    if meta.get("step_losses"):
        row["train_loss"] = float(meta["step_losses"][-1])
    return row | test_metrics(metrics[f"client_{client:03d}"]) | client_params(meta)


def client_aggregates(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``clients.count``, ``clients.diverged``, and for each numeric column but the client's id (its test metrics,
    ``num_examples``, ``train_loss``) its mean, population std and quantiles over the clients with a finite value
    (a multi-task run's ``<task>.test_<metric>`` over that task's clients)."""
    import numpy as np

    aggregates = {"clients.count": float(len(rows)), "clients.diverged": float(sum(row["diverged"] for row in rows))}
    columns: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            # Numbers only: the id is no measure, ``diverged`` is counted, settings are logged as strings; a
            # diverged client's NaN would make every statistic NaN.
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if key != "client" and number and math.isfinite(value):
                columns.setdefault(key, []).append(float(value))
    for key, values in columns.items():
        aggregates[f"clients.{key}_mean"] = float(np.mean(values))
        aggregates[f"clients.{key}_std"] = float(np.std(values))
        quantiles = np.quantile(values, list(_QUANTILES.values()))
        aggregates |= {f"clients.{key}_{name}": float(q) for name, q in zip(_QUANTILES, quantiles, strict=True)}
    return aggregates


def log_client_summary(mlflow: Any, root: Path, clients: list[int], metrics: dict[str, Any]) -> None:
    """Log the clients' aggregates (:func:`client_aggregates`) and their table (:data:`CLIENT_TABLE`) to the
    active run."""
    import pandas as pd

    rows = [client_row(root, client, metrics) for client in clients]
    mlflow.log_metrics(client_aggregates(rows))
    mlflow.log_table(pd.DataFrame(rows), artifact_file=CLIENT_TABLE)
