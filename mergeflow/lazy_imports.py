"""The imports the import walk cannot see: a registry's members, which their loaders import by name.

A loader (``family_of``, ``get_objective``, the permutation spec of a checkpoint) imports the module its
member's declaration names (:meth:`mergeflow.registry.Member.load`) when it runs, so no import statement
names that module. Code that reaches a loader is keyed by the members it says it runs (a step's
``members``) and, where it names none of a loader's members, by all of them: never by none.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mergeflow.import_graph import import_closure


def _loaded_by() -> dict[str, list[str]]:
    """Each loader's file, with the modules of the members it may import by name."""
    from mergeflow.schema.families import DECLARED as FAMILIES
    from mergeflow.schema.objectives import DECLARED as OBJECTIVES

    derivations = [family.permutation_spec or "" for family in FAMILIES.values()]
    return {
        "mergeflow/models/family.py": [family.module or "" for family in FAMILIES.values()],
        "mergeflow/objectives/base.py": [objective.module or "" for objective in OBJECTIVES.values()],
        "mergeflow/align/derive.py": [reference.partition(":")[0] for reference in derivations],
    }


def closure_with_members(modules: Sequence[str], root: Path) -> tuple[str, ...]:
    """Sorted paths, relative to ``root``, of the import closure of ``modules`` and of the members' modules
    its loaders may import: those among ``modules``, or every member of a loader where none of its is."""
    loaders = _loaded_by()
    named = set(modules)
    files: set[str] = set()
    done: set[str] = set()
    pending = list(modules)
    while pending:
        module = pending.pop()
        if not module or module in done:
            continue
        done.add(module)
        files.update(import_closure(module, root))
        for loader, members in loaders.items():
            if loader in files:
                pending += [m for m in members if m in named] or members
    return tuple(sorted(files))
