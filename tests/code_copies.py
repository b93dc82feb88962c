"""A copy of the repository's code to edit in a test: which files an edit touched, and a script run on it."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def copy_code(target: Path) -> Path:
    """A copy of the repository's tracked code (``mergeflow``, ``tasks``) under ``target``."""
    names = subprocess.run(["git", "ls-files", "mergeflow", "tasks"], cwd=ROOT, capture_output=True, text=True)
    for name in names.stdout.split():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target / name)
    return target


def digests(root: Path) -> dict[str, str]:
    """The sha256 of every Python file under ``root``, by path relative to it."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in root.rglob("*.py")
        if "__pycache__" not in path.parts
    }


def edited(before: dict[str, str], after: dict[str, str]) -> set[str]:
    """The files added, changed or removed between two :func:`digests`."""
    return {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)}


def run_on(code: Path, script: str) -> subprocess.CompletedProcess:
    """``script`` run by this interpreter with the copy ``code`` first on the import path."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    return subprocess.run([sys.executable, "-c", script], cwd=code.parent, env=env, capture_output=True, text=True)
