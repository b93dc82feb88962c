"""A registry of named members (objectives, model families, federated algorithms): a dict that refuses
a second member under one name and answers an unknown name with one line listing the known ones."""

from __future__ import annotations

from typing import Generic, TypeVar

from mergeflow.errors import ConfigError

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """Members by name; ``kind`` names them in errors (``"objective"``, ``"federated algorithm"``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def add(self, name: str, member: T) -> None:
        """Register ``member`` under ``name``.

        Raises:
            ValueError: when ``name`` is taken.
        """
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self[name] = member

    def lookup(self, name: str) -> T:
        """The member named ``name``.

        Raises:
            ConfigError: on an unknown name, listing the known ones.
        """
        if name not in self:
            raise ConfigError([f"{self.kind} {name!r} is unknown; known: {', '.join(self)}"])
        return self[name]
