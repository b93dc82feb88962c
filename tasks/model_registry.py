"""The Model Registry side of a logged merged model: its registered name, and a new version only for a new
checkpoint whose inputs match the name's versions' (the signature guard). ``mlflow`` is passed in."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from typing import Any


def registered_model_name(experiment: str, data: str, merge: str) -> str:
    """The Model Registry name of one merge entry: one registered model per experiment, data and merge, so that
    the versions of a name take the same inputs (another table's model is another model, not a new version)."""
    return f"{experiment}.{data}.{merge}"


def signature_digest(mlflow: Any, model_uri: str) -> str:
    """A digest of a logged model's signature (its inputs and outputs; ``none`` for a model logged without one)."""
    signature = mlflow.models.get_model_info(model_uri).signature
    text = json.dumps(signature.to_dict() if signature is not None else None, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def register(mlflow: Any, model_uri: str, name: str, tags: dict[str, str]) -> tuple[str | None, str | None]:
    """A new version of ``name`` unless a version already holds the same checkpoint (by sha256); says which.

    The logging step re-runs as a whole when any merge changed; this keeps the unchanged
    merges from gaining identical versions. MLflow's own two lines per version, printed straight to
    stderr, are kept off the console: the run's summary names the new versions instead. A model whose
    signature differs from the name's versions' (tag ``mergeflow.signature``) is not registered: the
    second value says why, for the summary.
    """
    client = mlflow.tracking.MlflowClient()
    digest = tags["mergeflow.checkpoint_sha256"]
    versions = client.search_model_versions(f"name='{name}'")
    if any(v.tags.get("mergeflow.checkpoint_sha256") == digest for v in versions):
        return None, None
    signatures = {v.tags["mergeflow.signature"] for v in versions if "mergeflow.signature" in v.tags}
    if signatures - {tags["mergeflow.signature"]}:
        return None, f"{name}: its versions take other inputs (set tracking.experiment to keep both)"
    with contextlib.redirect_stderr(io.StringIO()):
        version = mlflow.register_model(model_uri, name, tags=tags)
    return f"{name} version {version.version}", None
