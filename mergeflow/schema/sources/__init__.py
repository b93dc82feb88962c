"""The data sources, declared: one module of this package each, found and imported with the package.

A module here declares one :class:`~mergeflow.schema.data_source.DataSource` (torch-free, no I/O) and
registers it with :func:`~mergeflow.schema.data_source.register_source`; its loader is the module in
``mergeflow.data`` that its ``implementation`` names. Nothing lists the modules: a new source is a new
module here plus its loader module, so no file that a step's code closure holds changes, and no step of a
run on another source is re-keyed (:attr:`~mergeflow.schema.data_source.DataSource.modules` key the steps
that read it). See ``docs/architecture.md``.
"""

from __future__ import annotations

import importlib
import pkgutil

from mergeflow.schema.data_source import SOURCES, DataSource, register_source

__all__ = ["SOURCES", "DataSource", "canonical_name", "get_source", "register_source"]

for _declaration in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_declaration.name}")


def canonical_name(name: str) -> str:
    """The registered name for ``name`` or one of its aliases (the first use of an alias prints a notice).

    Raises:
        ConfigError: for an unknown name, with "did you mean" and the known names.
    """
    return SOURCES.canonical(name)


def get_source(name: str) -> DataSource:
    """The registered source ``name`` (or an alias of it).

    Raises:
        ConfigError: for an unknown name.
    """
    return SOURCES.lookup(name)
