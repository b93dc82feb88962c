"""What ``mergeflow methods`` and ``mergeflow algorithms`` print: each registered merge method or federated
algorithm, sorted by name, as a block of its summary (its docstring's first sentence), the inputs it
reads besides the weights, and its options with their defaults, wrapped to a terminal's width."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable, Mapping
from typing import Any

import yaml
from pydantic import BaseModel

WIDTH = 100
NAME_WIDTH = 18


def first_sentence(doc: str | None) -> str:
    """A docstring's first sentence, whole across line breaks, without reST's double backquotes."""
    paragraph = " ".join((doc or "").strip().split("\n\n")[0].split()).replace("``", "")
    match = re.match(r"(.+?[.!?])(?=\s+[A-Z]|$)", paragraph)
    return match.group(1) if match else paragraph


def _default(value: Any) -> str:
    """An option's default as it is written in params.yaml (``null``, ``true``, ``.inf``)."""
    return yaml.safe_dump(value, default_flow_style=True, allow_unicode=True).removesuffix("...\n").strip()


def option_defaults(options: type[BaseModel]) -> list[str]:
    """``name=default`` for each option of an options model (just ``name`` when it must be given)."""
    return [
        name if field.is_required() else f"{name}={_default(field.get_default(call_default_factory=True))}"
        for name, field in options.model_fields.items()
    ]


def render_block(name: str, summary: str, details: Mapping[str, Iterable[str]]) -> str:
    """One entry: its name and summary, then one wrapped line per non-empty detail (``options: a=1, b=2``)."""
    pad = " " * NAME_WIDTH
    lines = [
        textwrap.fill(
            summary or "(no summary)", WIDTH, initial_indent=f"{name:<{NAME_WIDTH - 1}} ", subsequent_indent=pad
        )
    ]
    for label, values in details.items():
        values = list(values)
        if values:
            head = f"{pad}{label}: "
            lines.append(
                textwrap.fill(", ".join(values), WIDTH, initial_indent=head, subsequent_indent=" " * len(head))
            )
    return "\n".join(lines)


def render_methods() -> str:
    """Every declared merge method (imports the methods' modules, hence torch)."""
    from mergeflow.merge import METHODS
    from mergeflow.schema.merge import NEEDS

    blocks = []
    for name in sorted(METHODS):
        method = METHODS[name]
        details = {
            "needs": [need for need in NEEDS if need in method.needs],
            "uses if given": [need for need in NEEDS if need in method.uses - method.needs],
            "options": option_defaults(method.Options),
        }
        blocks.append(render_block(name, first_sentence(method.load().__doc__), details))
    return "\n\n".join(blocks) + "\n"


def render_algorithms() -> str:
    """Every declared federated algorithm (imports the algorithms' modules, hence torch)."""
    from mergeflow.federated import ALGORITHMS

    blocks = []
    for name in sorted(ALGORITHMS):
        algorithm = ALGORITHMS[name]
        details = {"options": option_defaults(algorithm.Options)}
        blocks.append(render_block(name, first_sentence(algorithm.load().__doc__), details))
    return "\n\n".join(blocks) + "\n"
