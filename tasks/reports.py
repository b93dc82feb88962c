"""What a finished run tells its user besides its metrics, read from its outputs, torch-free: the
federated stage's and the evaluation's warnings (the command line prints them after a run)."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.layout import FEDERATED_INDEX, METRICS

SANITY = "sanity"  # the key of the input-blind baseline and its warning in METRICS


def run_warnings(root: Path) -> list[str]:
    """The federated stage's warnings (settings known to run away), one line each, if it gave any."""
    path = root / FEDERATED_INDEX
    if not path.is_file():
        return []
    warnings = json.loads(path.read_text()).get("warnings", {})
    return [f"federated.options.{name}: {text}" for name, text in warnings.items()]


def run_warning(root: Path) -> str | None:
    """The evaluation's sanity warning (models no better than ignoring the input), if it gave one."""
    path = root / METRICS
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(SANITY, {}).get("warning")
