"""A model given instead of made (``finetune.checkpoints``, a task's ``checkpoint``, ``pretrain.checkpoint``), as the
steps that read it take it: resolved on this machine, as step params, and where it came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mergeflow.errors import ConfigError
from mergeflow.given import Given, resolve
from tasks.store import sha256_file


def resolved_source(key: str, source: str) -> Given:
    """The source on this machine (a Hub name downloaded when online), or its one line."""
    try:
        given = resolve(key, source)
    except ValueError as error:
        raise ConfigError([f"{key}: {error}"]) from None
    assert given is not None  # fetched: a Hub name is downloaded or refused
    return given


def given_params(given: Given) -> dict[str, Any]:
    """A given model's facts as a step's params (its files key the step by content)."""
    return {"key": given.key, "source": given.source, "kind": given.kind, "path": str(given.path), "files": given.files}


def given_of(params: dict[str, Any]) -> Given:
    """The given model of a step's params (:func:`given_params`)."""
    return Given(params["key"], params["source"], params["kind"], Path(params["path"]), tuple(params["files"]))


def provenance(given: Given) -> dict[str, Any]:
    """What a given model's header says of where it came from: the source as given, its kind and its files' sha256."""
    return {"source": given.source, "kind": given.kind, "files": {f: sha256_file(Path(f)) for f in given.files}}
