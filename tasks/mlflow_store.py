"""Where MLflow records go, and whether a store holds a run, without importing MLflow for the local store.

The logging step's record says which parent run it logged; a cache hit of that step is only a hit while
the store it writes to still holds that run (:func:`holds_logged_run`). A pulled clone's new ``mlflow.db``,
or a store emptied by hand, therefore gets the runs logged (again), once.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import Any

from mergeflow.errors import MergeflowError


def tracking_uri(root: Path) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else an absolute SQLite store at the project root."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI (relative to the working directory unless absolute);
    None for any other store."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def store_exists(root: Path) -> bool:
    """Whether the tracking store exists; a server or any store that is not a local SQLite file counts as there."""
    database = sqlite_file(tracking_uri(root))
    return database is None or database.is_file()


def require_store(root: Path) -> str:
    """The tracking URI, when its store exists; for a local SQLite file not made yet, an error that says so
    (read-only commands must not create an empty store)."""
    uri = tracking_uri(root)
    if not store_exists(root):
        raise MergeflowError(f"no MLflow store at {uri}: run `mergeflow run` first, or set MLFLOW_TRACKING_URI")
    return uri


def holds_run(root: Path, run_id: str) -> bool:
    """Whether the tracking store holds the run ``run_id``, not deleted."""
    uri = tracking_uri(root)
    database = sqlite_file(uri)
    if database is not None:
        if not database.is_file():
            return False
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as connection:
            try:
                row = connection.execute("SELECT lifecycle_stage FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()
            except sqlite3.DatabaseError:  # not an MLflow store (yet): no runs tables
                return False
        return row is not None and row[0] == "active"
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        return MlflowClient(uri).get_run(run_id).info.lifecycle_stage == "active"
    except MlflowException:
        return False


def holds_logged_run(root: Path, record: dict[str, Any]) -> bool:
    """Whether the store holds the parent run that the logging step's ``record`` logged (its ``Step.holds`` check)."""
    run_id = record.get("summary", {}).get("run_id")
    return isinstance(run_id, str) and holds_run(root, run_id)
