"""Searches over merge options: an option given as a list of numbers is a search over those values.

Several lists make a grid. Candidates are scored on a validation split and the best one is kept
(``choose``); test data plays no part in the choice.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from mergeflow.errors import ConfigError
from mergeflow.metric_direction import lower_is_better


def _is_search(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)


def search_grid(options: Mapping[str, Any], prefix: str = "") -> list[dict[str, Any]]:
    """Every option set a search covers, in list order (the first list varies slowest); ``[options]``
    when no option is a list. An empty list is a ``ConfigError`` naming ``prefix + key``."""
    searched = [key for key, value in options.items() if _is_search(value)]
    for key in searched:
        if not options[key]:
            raise ConfigError([f"{prefix}{key}: an empty search list; give at least one value"])
    if not searched:
        return [dict(options)]
    grid = itertools.product(*(options[key] for key in searched))
    return [{**options, **dict(zip(searched, values, strict=True))} for values in grid]


def searched_keys(options: Mapping[str, Any]) -> list[str]:
    """The options that are searches (lists of numbers)."""
    return [key for key, value in options.items() if _is_search(value)]


def candidate_id(options: Mapping[str, Any]) -> str:
    """A short name for one candidate, from its options' content (stable when other values are added)."""
    return hashlib.sha256(json.dumps(dict(options), sort_keys=True).encode()).hexdigest()[:10]


def choose(scores: Sequence[Mapping[str, float]], select_by: str) -> int:
    """The index of the best candidate by ``select_by`` (a key of each score dict); ties go to the first."""
    sign = 1.0 if lower_is_better(select_by) else -1.0
    return min(range(len(scores)), key=lambda i: (sign * scores[i][select_by], i))
