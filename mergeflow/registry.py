"""The one registry shape: named, torch-free declarations whose code is imported only when used.

Every axis (data source, model family, objective, merge method, federated algorithm, aggregator, server
optimizer, attack) declares each member once: its ``name``, older ``aliases``, its ``Options`` model (the
params section it reads) and capability flags, all plain data, plus ``implementation``, a ``"module:attr"``
reference to the code that runs it. Validating params imports the declarations only; a step imports its
member's module only (:meth:`Member.load`), and its cache key hashes that module's import closure, not
every member's (:meth:`Member.module`), so editing one member re-runs only the steps that use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any, Generic, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from mergeflow.errors import ConfigError, did_you_mean


class NoOptions(BaseModel):
    """Options of a member that takes none."""

    model_config = ConfigDict(extra="forbid")


class Member:
    """A declared member: ``name``, ``aliases``, ``Options`` and ``implementation`` (``"module:attr"``).

    Subclasses add their axis's capability flags. A declaration may be a class with these as class
    attributes (registered as one instance) or a dataclass with them as fields: both read the same.
    """

    name: str
    aliases: tuple[str, ...] = ()
    Options: type[BaseModel] = NoOptions
    implementation: str = ""

    @property
    def module(self) -> str | None:
        """The module of its implementation (None without one): what keys the steps that use it."""
        return self.implementation.partition(":")[0] or None

    def load(self, reference: str | None = None) -> Any:
        """Its implementation, or ``reference``, another ``"module:attr"`` it declares (a merge method's
        ``masks``), imported now (``ImportError`` names the reference when it is wrong)."""
        module, _, attr = (reference or self.implementation).partition(":")
        if not module or not attr:
            raise ImportError(f"{type(self).__name__} {self.name!r} has no implementation ('module:attr')")
        return imported(reference or self.implementation, owner=repr(self.name))


def imported(reference: str, owner: str = "") -> Any:
    """The object a ``"module:attr"`` reference names, its module imported now; ``owner`` (who holds the
    reference) prefixes the error.

    Raises:
        ImportError: when the module has no such attribute (and as ``import`` does for a missing module).
    """
    module, _, attr = reference.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except AttributeError:
        where = f"{owner}: " if owner else ""
        raise ImportError(f"{where}{module} has no {attr!r} ({reference})") from None


class Named(Protocol):
    """What a registry needs of a member: its name (and, optionally, ``aliases``)."""

    name: str


T = TypeVar("T")
M = TypeVar("M", bound=Named)


class Registry(dict[str, T], Generic[T]):
    """Members by name; ``kind`` names them in errors (``"merge method"``), ``key`` is the params key that
    names one (``"merge.methods"``), for the error lines. Aliases resolve to their member with a one-line
    deprecation notice, ``notice`` formatted with ``key``, ``old`` and ``new``; an unknown name gets "did
    you mean" and the known names."""

    def __init__(self, kind: str, key: str | None = None, notice: str = "{key} {old!r} is now {new!r}") -> None:
        super().__init__()
        self.kind = kind
        self.key = key
        self.notice = notice
        self.aliases: dict[str, str] = {}

    def add(self, name: str, member: T, aliases: Iterable[str] = ()) -> T:
        """Register ``member`` under ``name`` and its older ``aliases``; the member.

        Raises:
            ValueError: when a name is taken, or when the member's ``Options`` accept extra keys.
        """
        names = [name, *aliases]
        taken = [n for n in names if n in self or n in self.aliases]
        if taken:
            raise ValueError(f"{self.kind} {taken[0]!r} is registered twice")
        options = getattr(member, "Options", None)
        strict = not isinstance(options, type) or options.model_config.get("extra") == "forbid"
        if not strict:
            raise ValueError(f"options of {self.kind} {name!r} must forbid extra keys")
        self[name] = member
        self.aliases.update(dict.fromkeys(aliases, name))
        return member

    def declare(self, member: M) -> M:
        """Register a declaration under its own ``name`` and ``aliases``; the declaration."""
        return self.add(member.name, member, getattr(member, "aliases", ()))  # type: ignore[arg-type, return-value]

    def canonical(self, name: str) -> str:
        """The registered name of ``name`` or of an alias of it (an alias prints a deprecation notice once).

        Raises:
            ConfigError: on an unknown name, with "did you mean" and the known names.
        """
        if name in self:
            return name
        if name in self.aliases:
            from mergeflow.schema.deprecation import deprecated

            deprecated(self.notice.format(key=self.key or self.kind, old=name, new=self.aliases[name]))
            return self.aliases[name]
        where = f"{self.key}: " if self.key else ""
        hint = did_you_mean(name, self)
        raise ConfigError([f"{where}{self.kind} {name!r} is unknown{hint}; known: {', '.join(self)}"])

    def lookup(self, name: str) -> T:
        """The member named ``name`` (or an alias of it); ConfigError as :meth:`canonical` for an unknown one."""
        return self[self.canonical(name)]
