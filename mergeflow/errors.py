"""Errors that the command line turns into one clear line and exit code 2."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class MergeflowError(Exception):
    """Bad input from the user: a config key, a file or data that cannot be used."""


class ConfigError(MergeflowError):
    """A params file or override that fails validation.

    ``lines`` holds one message per problem, each naming the offending key.
    """

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines

    @classmethod
    def from_validation(cls, prefix: str, error: ValidationError) -> ConfigError:
        """One line naming ``prefix`` + the first invalid key of a pydantic ``ValidationError``, and why."""
        first = error.errors()[0]
        key = ".".join(str(part) for part in first["loc"])
        return cls([f"{prefix}{key}: {first['msg']}"])
