"""Reading and validating a params file or mapping: the schema, then the cross-section rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from mergeflow.config.cross_section_rules import check_cross_section_rules
from mergeflow.config.error_lines import problem_lines, rule_line
from mergeflow.config.overrides import apply_overrides
from mergeflow.config.params import Params
from mergeflow.errors import ConfigError


def validate_params(raw: dict[str, Any], source: str = "params", overrides: list[str] | None = None) -> Params:
    """Validate a raw params mapping; raise ConfigError with one line per problem. A problem with a key that one
    of ``overrides`` (``-S`` texts, already applied to ``raw``) set names that override instead of ``source``."""
    if not isinstance(raw, dict):
        raise ConfigError([f"{source}: expected a mapping of sections at the top level"])
    try:
        params = Params.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(problem_lines(error, source, raw, overrides)) from None
    try:
        check_cross_section_rules(params)
    except ValueError as error:
        raise ConfigError([rule_line(error, source, raw, overrides)]) from None
    return params


def load_params(path: str | Path = "params.yaml", overrides: list[str] | None = None) -> Params:
    """Read, override and validate a params file. Errors name the file and key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"{path}: params file not found"])
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError([f"{path}: not valid YAML: {error}".replace("\n", " ")]) from None
    return validate_params(apply_overrides(raw, overrides or []), str(path), overrides)
