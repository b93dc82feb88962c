"""The data package's error type."""

from __future__ import annotations

from mergeflow.errors import MergeflowError


class DataError(MergeflowError, ValueError):
    """Data that cannot be loaded, split or partitioned as configured."""
