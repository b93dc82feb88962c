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
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from mergeflow.checkpoints import atomic_path

STATE_DIR = ".mergeflow"
_IGNORED_PARTS = {"__pycache__", ".ipynb_checkpoints"}


# sha256 by (path, device, inode, size, mtime, ctime): like DVC's state database, a file is
# hashed again only when one of these changes. Every write here replaces a file (a new
# inode); ctime also catches in-place writers that restore the mtime (cp -p, rsync --inplace).
_Signature = tuple[str, int, int, int, int, int]
_HASHES: dict[_Signature, str] = {}
_HASHES_LOCK = threading.Lock()
_SETTLED_NS = 1_000_000_000


def file_signature(path: Path) -> _Signature:
    """What identifies a file's content without reading it: path, device, inode, size, mtime, ctime."""
    stat = path.stat()
    return (os.path.abspath(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes (memoised on the file's path, inode, size and mtime)."""
    signature = file_signature(path)
    with _HASHES_LOCK:
        known = _HASHES.get(signature)
    if known is not None:
        return known
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    # "Racy git": a file written within the clock's granularity could change again with the
    # same size and mtime, so only settled files are remembered.
    if time.time_ns() - max(signature[4], signature[5]) < _SETTLED_NS:
        return digest.hexdigest()
    return _remember(signature, digest.hexdigest())


def _remember(signature: _Signature, digest: str) -> str:
    with _HASHES_LOCK:
        if len(_HASHES) > 100_000:  # a bound for long-lived processes; rebuilt on demand
            _HASHES.clear()
        _HASHES[signature] = digest
    return digest


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
            name = file.relative_to(root).as_posix() if file.is_relative_to(root) else file.as_posix()
            hashes[name] = sha256_file(file)
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
            # Just written from the blob, as a new inode: its digest is known, settled or not.
            _remember(file_signature(target), digest)

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
