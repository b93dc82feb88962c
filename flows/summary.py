"""A run's summary on the console, as ``mergeflow run`` and each run of ``mergeflow serve`` print it."""

from __future__ import annotations

import sys
from typing import Any


def print_summary(outcomes: list[dict[str, Any]], elapsed: float) -> None:
    """Print a run's summary, as ``mergeflow run`` and each run of ``mergeflow serve`` do: its steps, run or
    cached, the steps run and the model versions they registered.

    Written to stdout, not printed: inside a flow (``serve``'s runs), Prefect turns prints into log records.
    """
    ran = [o["name"] for o in outcomes if not o["cached"]]
    lines = [f"mergeflow: {len(outcomes)} steps in {elapsed:.1f}s: {len(ran)} ran, {len(outcomes) - len(ran)} cached"]
    if ran:
        lines.append("  ran: " + step_summary(ran))
    for kind in ("registered", "not_registered"):
        names = [v for o in outcomes if not o["cached"] for v in o["summary"].get(kind, [])]
        lines += [f"  {kind.replace('_', ' ')}: " + ", ".join(names)] if names else []
    sys.stdout.write("".join(line + "\n" for line in lines))
    sys.stdout.flush()


def step_summary(names: list[str], limit: int = 8) -> str:
    """Step names, with more than ``limit`` under one prefix (e.g. federated rounds) told as a count.

    The full list is in ``.mergeflow/last_run.json``.
    """
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(name.split("/", 1)[0], []).append(name)
    parts: list[str] = []
    for prefix, members in groups.items():
        parts += members if len(members) <= limit else [f"{prefix}/… ({len(members)} steps)"]
    return ", ".join(parts)
