"""Errors that the command line turns into one clear line: exit code 2 for bad input, 1 for an outage."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class MergeflowError(Exception):
    """Bad input from the user: a config key, a file or data that cannot be used."""


class Outage(MergeflowError):
    """Something a run stands on went away (its Dask workers): not bad input, the same command succeeds once it is
    back, so the command line exits 1."""


class Cancelled(MergeflowError):
    """A step stopped at a cancellation check because the run was asked to stop (:mod:`mergeflow.cancel`)."""


class ConfigError(MergeflowError):
    """A params file or override that fails validation.

    ``lines`` holds one message per problem, each naming the offending key.
    """

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines

    @classmethod
    def from_validation(cls, key: str, error: ValidationError) -> ConfigError:
        """One line naming the first invalid key of a pydantic ``ValidationError`` under ``key``, and why."""
        return cls([first_problem(key, error)])


def first_problem(key: str, error: ValidationError) -> str:
    """``key.sub.key: why`` for the first problem of a pydantic ``ValidationError`` that validated ``key``
    (just ``key: why`` when the value itself is wrong, e.g. a number where a mapping belongs)."""
    first = error.errors()[0]
    # pydantic names its model class ("a valid dictionary or instance of TrainOverride"): not the user's word
    why = "unknown key" if first["type"] == "extra_forbidden" else re.sub(r" or instance of \w+", "", first["msg"])
    return f"{'.'.join([key, *(str(part) for part in first['loc'])])}: {why}"


def closest(word: str, known: Iterable[str]) -> str | None:
    """The known name most like ``word`` (a likely misspelling of it), or None when none is close."""
    matches = difflib.get_close_matches(word, [str(name) for name in known], n=1)
    return matches[0] if matches else None


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known name closest to ``word``, or an empty string."""
    match = closest(word, known)
    return f" (did you mean {match!r}?)" if match else ""
