"""``-S key=value`` overrides: parsed with YAML rules and set at their dotted path."""

from __future__ import annotations

import copy
import re
from typing import Any

import yaml

from mergeflow.errors import ConfigError


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``a.b=value``; the value is parsed with YAML rules, as ``dvc exp run -S`` does."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError([f"-S {text}: expected KEY=VALUE, e.g. -S merge.methods=[average]"])
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of ``raw`` with each ``key=value`` override set at its dotted path."""
    result = copy.deepcopy(raw)
    for text in overrides:
        key, value = parse_override(text)
        node = result
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError([f"-S {text}: {part} is not a section"])
            node = child
        node[parts[-1]] = value
    return result


def given_by(key: str, overrides: list[str]) -> str | None:
    """``-S a.b=v``: the last override that set ``key``, a section above it, or a key below it; None for none."""
    parts = re.sub(r"\[\d+\]", "", key).split(".") if key else []  # merge.methods[0] was given as merge.methods
    for text in reversed(overrides):
        given = text.partition("=")[0].strip().split(".")
        shared = min(len(given), len(parts))
        if parts and given[:shared] == parts[:shared]:
            return f"-S {text}"
    return None
