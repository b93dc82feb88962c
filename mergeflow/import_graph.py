"""The source files a module runs: its import closure inside one source tree, found statically.

A cached step's key hashes the code it runs, so that editing any module it imports, even
transitively, re-runs it, and editing one it does not import re-runs nothing. Nobody keeps a list:
:func:`import_closure` walks the module's syntax tree (every ``import`` and ``from … import``
statement anywhere in it, function-level and ``if TYPE_CHECKING:`` ones included, without running
anything), follows each import that resolves to a file under the root, and repeats. Importing
``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` too, so those count. A name that a
package serves lazily (PEP 562 ``__getattr__``, e.g. ``from pkg import served_lazily``)
is not bound in the package's ``__init__.py``, so the walk cannot tell which submodule holds it
and counts every module of that package; so does any import of a package whose ``__init__.py``
defines ``__getattr__`` (``from pkg import sub``, ``import pkg as p``, a star import), as
its attributes may then reach any of them. A missed file would be a stale result, an extra one
only an extra re-run. The parsed files are kept for the life of the process: a long-running
process follows an import added after its first keying only once restarted. Imports of
third-party packages are not followed (as DVC does not hash them); :func:`third_party_versions`
reports the versions that a run's records note instead.
``importlib.import_module`` with a computed name is not seen: the registry members that steps import by name
(:meth:`mergeflow.registry.Member.load`) join a step's code through ``Step.members`` and
:mod:`mergeflow.lazy_imports`.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

RECORDED_PACKAGES = (
    "torch",
    "numpy",
    "numba",
    "transformers",
    "peft",
    "ivon-opt",
    "safetensors",
    "scikit-learn",
    "datasets",
)


@functools.cache
def module_file(name: str, root: Path) -> Path | None:
    """The file of module ``name`` under ``root`` (``a/b.py`` or ``a/b/__init__.py``), or None."""
    base = root.joinpath(*name.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):  # a package wins, as in Python
        if candidate.is_file():
            return candidate
    return None


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if node.level == 0:
        return node.module or ""
    parts = package.split(".") if package else []
    base = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
    return ".".join([*base, node.module] if node.module else base)


def _bound_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level (definitions, assignments, imports)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AugAssign) or (isinstance(node, ast.AnnAssign) and node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_bytes(), filename=str(path))


def _package_modules(package: str, root: Path) -> list[str]:
    directory = root.joinpath(*package.split("."))
    return [
        ".".join([*package.split("."), *p.relative_to(directory).with_suffix("").parts]).removesuffix(".__init__")
        for p in sorted(directory.rglob("*.py"))
    ]


def _import_statements(statements: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement among ``statements`` and the statements nested in them (function and
    class bodies, branches, ``try`` and ``with`` blocks); expressions hold none, so they are skipped."""
    for node in statements:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
            continue
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                yield from _import_statements(block)


@functools.cache
def _imported(name: str, path: Path, root: Path) -> tuple[str, ...]:
    """The module names that module ``name`` (at ``path``) imports, resolved against ``root``."""
    tree, package, found = _parsed(path), _package_of(name, path), []
    for node in _import_statements(tree.body):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            found.append(base)
            init = module_file(base, root)
            for alias in node.names:
                if alias.name == "*":
                    continue
                if module_file(f"{base}.{alias.name}", root) is not None:
                    found.append(f"{base}.{alias.name}")
                elif init is not None and init.name == "__init__.py" and alias.name not in _bound_names(_parsed(init)):
                    found += _package_modules(base, root)  # served lazily: any of its modules may hold it
    return tuple(found)


@functools.cache
def import_closure(module: str, root: Path) -> tuple[str, ...]:
    """Sorted paths, relative to ``root``, of ``module``'s file and every file under ``root`` it imports,
    transitively (with the ``__init__.py`` of every package on the way); cached per process."""
    seen: set[str] = set()
    files: set[Path] = set()
    pending = [module]
    while pending:
        name = pending.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        parts = name.split(".")
        pending += [".".join(parts[:i]) for i in range(1, len(parts))]  # the parent packages run first
        path = module_file(name, root)
        if path is None:
            continue
        files.add(path)
        pending += _imported(name, path, root)
        if path.name == "__init__.py" and "__getattr__" in _bound_names(_parsed(path)):
            pending += _package_modules(name, root)  # serves names lazily, however it is reached
    return tuple(sorted(str(path.relative_to(root)) for path in files))


def _dependencies(name: str, root: Path) -> set[str]:
    """The modules whose code module ``name`` runs through its imports: the modules it names, and the packages
    on their way, except its own enclosing packages, which ran before it (unless it takes a name from one)."""
    path = module_file(name, root)
    tree, package = _parsed(path), _package_of(name, path)
    enclosing = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    found: set[str] = set()

    def named(module: str) -> None:
        parts = module.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))

    for node in _import_statements(tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                named(alias.name)
        else:
            base = _absolute(node, package)
            named(base)
            for alias in node.names:
                if alias.name != "*" and module_file(f"{base}.{alias.name}", root) is not None:
                    found.add(f"{base}.{alias.name}")
                elif base in enclosing:
                    enclosing.discard(base)  # a name its package's __init__.py defines: a real dependency
    return found - enclosing


def import_cycles(root: Path, packages: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The import circles among the modules of ``packages`` under ``root``: each a sorted tuple of the module
    names of one strongly connected component of the graph of explicit imports (function-level ones
    included; a package's own submodules, run when one of them is imported, are not edges of it)."""
    modules = [m for package in packages for m in _package_modules(package, root) if module_file(m, root)]
    known = set(modules)
    edges = {m: sorted(_dependencies(m, root) & known - {m}) for m in modules}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[tuple[str, ...]] = []
    for start in modules:  # Tarjan's algorithm, iteratively: the graph is deeper than the recursion limit allows
        if start in order:
            continue
        work = [(start, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                order[node] = low[node] = len(order)
                stack.append(node)
            if child < len(edges[node]):
                work.append((node, child + 1))
                target = edges[node][child]
                if target not in order:
                    work.append((target, 0))
                elif target in stack:
                    low[node] = min(low[node], order[target])
                continue
            if low[node] == order[node]:
                component = stack[stack.index(node) :]
                del stack[stack.index(node) :]
                if len(component) > 1:
                    cycles.append(tuple(sorted(component)))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return sorted(cycles)


@functools.cache
def third_party_versions(packages: tuple[str, ...] = RECORDED_PACKAGES) -> dict[str, str]:
    """The installed versions of the third-party packages whose changes keys ignore (absent ones left
    out), read once per process: the same dict every call, not to be changed."""
    from importlib import metadata  # only where versions are recorded: not on the CLI's start-up path

    versions = {}
    for package in packages:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return versions
