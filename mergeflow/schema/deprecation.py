"""One-line notices of deprecated params spellings, each printed once per process on stderr."""

from __future__ import annotations

import sys

_shown: set[str] = set()


def deprecated(message: str) -> None:
    """Print ``mergeflow: deprecated: <message>`` on stderr, the first time this message comes up."""
    if message not in _shown:
        _shown.add(message)
        print(f"mergeflow: deprecated: {message}", file=sys.stderr)
