"""A params problem as one line that names its key, where it was given, and the key it most looks like."""

from __future__ import annotations

import json
import re
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from mergeflow.config.data_sections import DataConfig
from mergeflow.config.overrides import given_by
from mergeflow.config.params import Params
from mergeflow.config.training_sections import TrainOverride
from mergeflow.errors import closest
from mergeflow.schema.sources import SOURCES


def problem_lines(
    error: ValidationError, source: str, raw: dict[str, Any], overrides: list[str] | None = None
) -> list[str]:
    """One line per problem of the schema, each naming where its key was given: ``source``, or the ``-S``
    override (of ``overrides``, already applied to ``raw``) that set it."""
    lines = []
    for item in error.errors():
        unknown = item["type"] == "extra_forbidden"
        message = "unknown key" if unknown else item["msg"].removeprefix("Value error, ")
        scalar = not isinstance(item["input"], dict | list) and not unknown
        shown = f" (got {json.dumps(item['input'], default=str)})" if scalar else ""
        key = ".".join(str(p) for p in item["loc"])
        lines.append(_line(key, message, shown, source, raw, overrides or []))
    return lines


def rule_line(error: ValueError, source: str, raw: dict[str, Any], overrides: list[str] | None = None) -> str:
    """The line of a broken cross-section rule, whose message is ``key: problem``, as :func:`problem_lines`'."""
    return _line("", str(error), "", source, raw, overrides or [])


def _line(key: str, message: str, shown: str, source: str, raw: dict[str, Any], overrides: list[str]) -> str:
    subkey = re.match(r"^([\w.\[\]]+): (.*)$", message)
    if subkey:  # a validator that names the exact key below its section
        key = f"{key}.{subkey.group(1)}" if key else subkey.group(1)
        message = subkey.group(2)
    if message == "unknown key":
        message += _suggested_key(key.split("."), raw)
    where = f"{key}: " if key else ""
    return f"{given_by(key, overrides) or source}: {where}{message}{shown}"


def _suggested_key(parts: list[str], raw: dict[str, Any]) -> str:
    """``; did you mean a.b.c?`` for the known key beside an unknown one that it most looks like."""
    match = closest(parts[-1], _keys_below(parts[:-1], raw))
    return f"; did you mean {'.'.join([*parts[:-1], match])}?" if match else ""


def _keys_below(parts: list[str], raw: Any) -> list[str]:
    """The keys the schema allows right below the dotted key ``parts`` ([] where it cannot tell): the fields
    of the section's model, a data source's options, or a merge or federated entry's options by its kind."""
    for kinds, kind_key, extra in (
        ("merge", "method", ("method",)),
        ("federated", "algorithm", ("algorithm", "local")),
    ):
        if len(parts) == 3 and parts[:2] == [kinds, "options"]:
            entry = _raw_at(raw, parts)
            kind = entry.get(kind_key, parts[2]) if isinstance(entry, dict) else parts[2]
            declared = _declared_options(kinds)
            return [*extra, *declared[kind].model_fields] if kind in declared else list(extra)
    if parts == ["data"]:
        return [*DataConfig.model_fields, *SOURCES]
    if len(parts) == 2 and parts[0] == "data" and parts[1] in (*SOURCES, *SOURCES.aliases):
        return list(SOURCES[SOURCES.aliases.get(parts[1], parts[1])].Options.model_fields)
    if len(parts) == 4 and parts[:2] == ["federated", "options"] and parts[3] == "local":
        return list(TrainOverride.model_fields)
    node: Any = Params
    for part in parts:
        node = _child_type(node, part)
    return next((list(option.model_fields) for option in _members(node) if _is_model(option)), [])


def _child_type(annotation: Any, part: str) -> Any:
    """The type of ``part`` below a value of type ``annotation`` (a model's field, a dict's or list's item)."""
    for option in _members(annotation):
        if _is_model(option):
            field = option.model_fields.get(part)
            return field.annotation if field else None
        if get_origin(option) in (dict, list):
            return get_args(option)[-1]
    return None


def _members(annotation: Any) -> tuple[Any, ...]:
    """The types of a union (``X | None``), or the one type."""
    return get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _raw_at(raw: Any, parts: list[str]) -> Any:
    for part in parts:
        raw = raw.get(part) if isinstance(raw, dict) else None
    return raw


def _declared_options(kinds: str) -> dict[str, type[BaseModel]]:
    """The options model of each declared merge method (``kinds`` merge) or federated algorithm."""
    if kinds == "merge":
        from mergeflow.schema.merge import DECLARED

        return {name: declaration.Options for name, declaration in DECLARED.items()}
    from mergeflow.schema.federated import ALGORITHMS

    return {name: declaration.Options for name, declaration in ALGORITHMS.items()}
