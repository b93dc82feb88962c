"""A content-addressed artifact store under ``.mergeflow/store``, like DVC's own cache.

Steps write their outputs into a scratch directory; each file is moved into the store
under its sha256 and then copied to its declared path. So a kill leaves no half-written
output, finished steps stay available for a resume, and a cached step can always
re-materialise the outputs that DVC deletes before it runs a stage.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from mergeflow.checkpoints import atomic_path

STATE_DIR = ".mergeflow"
_IGNORED_PARTS = {"__pycache__", ".ipynb_checkpoints"}


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not _IGNORED_PARTS.intersection(p.parts) and not p.name.endswith((".pyc", ".tmp"))
    )


def hash_paths(root: Path, paths: Iterable[str]) -> dict[str, str]:
    """sha256 of every file under each path (files or directories), keyed by relative path.

    A missing path hashes to ``"missing"`` so that its later appearance changes the key.
    """
    hashes: dict[str, str] = {}
    for rel in paths:
        target = root / rel
        if not target.exists():
            hashes[rel] = "missing"
            continue
        for file in _files_under(target):
            hashes[file.relative_to(root).as_posix()] = sha256_file(file)
    return hashes


class ArtifactStore:
    """Blobs named by their sha256 under ``<root>/.mergeflow/store``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / STATE_DIR / "store"
        self.scratch = root / STATE_DIR / "tmp"

    def blob(self, digest: str) -> Path:
        """Where the blob with this sha256 lives."""
        return self.blobs / digest[:2] / digest

    def has(self, manifest: dict[str, str]) -> bool:
        """Whether every file of a manifest is in the store."""
        return all(self.blob(d).is_file() for d in manifest.values())

    def scratch_dir(self) -> tempfile.TemporaryDirectory:
        """A temporary directory on the same filesystem as the store (so moves are renames)."""
        self.scratch.mkdir(parents=True, exist_ok=True)
        return tempfile.TemporaryDirectory(dir=self.scratch)

    def ingest(self, workdir: Path) -> dict[str, str]:
        """Move every file under ``workdir`` into the store; return {relative path: sha256}."""
        manifest = {}
        for file in _files_under(workdir):
            digest = sha256_file(file)
            target = self.blob(digest)
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(file, target)
            manifest[file.relative_to(workdir).as_posix()] = digest
        return manifest

    def materialise(self, manifest: dict[str, str]) -> None:
        """Copy each blob to its path under the project root, atomically, unless already current."""
        for rel, digest in manifest.items():
            target = self.root / rel
            if target.is_file() and target.stat().st_size == self.blob(digest).stat().st_size:
                if sha256_file(target) == digest:
                    continue
            with atomic_path(target) as tmp:
                shutil.copyfile(self.blob(digest), tmp)

    def prune_outputs(self, produced: Iterable[str], keep: Iterable[str]) -> list[str]:
        """Delete files under a stage's output paths that no step produced (e.g. a removed client)."""
        keep = set(keep)
        removed = []
        for rel in produced:
            target = self.root / rel
            if not target.exists():
                continue
            for file in _files_under(target):
                name = file.relative_to(self.root).as_posix()
                if name not in keep:
                    file.unlink()
                    removed.append(name)
        return removed
