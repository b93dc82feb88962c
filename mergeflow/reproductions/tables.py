"""Markdown tables and mean ± std cells for the reproductions' results."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation over replicates (0 for one value)."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def mean_std_cell(values: Sequence[float], digits: int = 4) -> str:
    """``mean ± std`` over replicates, as a table cell."""
    mean, spread = mean_std(values)
    return f"{mean:.{digits}f} ± {spread:.{digits}f}"
