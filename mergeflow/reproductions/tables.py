"""Markdown tables and mean ± std cells for the reproductions' results."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def mean_std_cell(values: Sequence[float], digits: int = 4) -> str:
    """``mean ± std`` over replicates (sample std; 0 for one value)."""
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {spread:.{digits}f}"
