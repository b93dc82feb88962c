"""Where MLflow records go, and whether a store holds a run, without importing MLflow for the local store.

The logging step's record says which parent run it logged; a cache hit of that step is only a hit while
the store it writes to still holds that run (:func:`holds_logged_run`). A pulled clone's new ``mlflow.db``,
or a store emptied by hand, therefore gets the runs logged (again), once.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from mergeflow.errors import MergeflowError


def tracking_uri(root: Path) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else an absolute SQLite store at the project root."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(root / 'mlflow.db').resolve()}"


_REMOTE_SCHEMES = ("http", "https", "databricks", "databricks-uc")


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI (relative to the working directory unless absolute,
    without SQLAlchemy's ``?query``); None for any other store."""
    return Path(uri.removeprefix("sqlite:///").partition("?")[0]) if uri.startswith("sqlite:///") else None


def is_remote(uri_setting: str) -> bool:
    """Whether ``MLFLOW_TRACKING_URI``'s value names a tracking server (shared by every clone that names it),
    not a store on this machine (a SQLite file, a folder; ``local``: the project's own ``mlflow.db``)."""
    return uri_setting.partition(":")[0].lower() in _REMOTE_SCHEMES


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
    """Whether the tracking store holds the run ``run_id``, not deleted.

    Only an answer that the run is not there (or deleted) is a no: a store that cannot be asked (a server
    down, a refused login) is taken to hold it, with a line on stderr, so that an unreachable server neither
    fails a run that has nothing to log nor gets everything logged again once it is back.
    """
    uri = tracking_uri(root)
    database = sqlite_file(uri)
    if database is not None:
        return database.is_file() and _sqlite_holds(database, run_id)
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        return MlflowClient(uri).get_run(run_id).info.lifecycle_stage == "active"
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        print(f"mergeflow: warning: could not ask {uri} for run {run_id} ({error}); taken as logged", file=sys.stderr)
        return True


def _sqlite_holds(database: Path, run_id: str) -> bool:
    """Whether the SQLite store ``database`` holds the active run ``run_id`` (read-only: a reader creates nothing)."""
    location = f"file:{urllib.parse.quote(str(database.resolve()))}?mode=ro"
    with contextlib.closing(sqlite3.connect(location, uri=True, timeout=30)) as connection:
        try:
            row = connection.execute("SELECT lifecycle_stage FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()
        except sqlite3.OperationalError as error:
            if "no such table" in str(error):  # a file that holds no MLflow store (yet)
                return False
            raise
    return row is not None and row[0] == "active"


def holds_logged_run(root: Path, record: dict[str, Any]) -> bool:
    """Whether the store holds the parent run that the logging step's ``record`` logged (its ``Step.holds`` check)."""
    run_id = record.get("summary", {}).get("run_id")
    return isinstance(run_id, str) and holds_run(root, run_id)
