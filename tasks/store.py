"""A content-addressed artifact store under ``.mergeflow/store``, like DVC's own cache.

Steps write their outputs into a scratch directory; each file is moved into the store
under its sha256, made read-only, and hard-linked to its declared path (copied where a link
cannot be made). So a kill leaves no half-written output, finished steps stay available for a
resume, a cached step can always re-materialise the outputs that DVC deletes before it runs a
stage, and an output costs neither a copy nor twice its disk space. As with DVC's hard-link
cache, an output is the store's blob: it is replaced by renames (as every writer here does), and
its read-only mode refuses in-place writes, which would change the cached copy too; a blob written
into anyway (by root) is caught by its modification time (:meth:`ArtifactStore.has`) and made again.
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

from mergeflow.files import atomic_path

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
    found = []
    for folder, folders, files in os.walk(path):  # 2-3x faster than Path.rglob
        folders[:] = [name for name in folders if name not in _IGNORED_PARTS]
        found += [os.path.join(folder, name) for name in files if not name.endswith((".pyc", ".tmp"))]
    return sorted(Path(file) for file in found)


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


_READ_ONLY = 0o444


def _current(target: Path, blob: Path, digest: str) -> bool:
    """Whether ``target`` already holds ``blob``'s content: the blob itself (a link), or equal bytes."""
    found, stored = target.stat(), blob.stat()
    if (found.st_dev, found.st_ino) == (stored.st_dev, stored.st_ino):
        return True
    return found.st_size == stored.st_size and sha256_file(target) == digest


class ArtifactStore:
    """Blobs named by their sha256 under ``<root>/.mergeflow/store``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / STATE_DIR / "store"
        self.scratch = root / STATE_DIR / "tmp"

    def blob(self, digest: str) -> Path:
        """Where the blob with this sha256 lives."""
        return self.blobs / digest[:2] / digest

    def stamps(self, manifest: dict[str, str]) -> dict[str, int]:
        """Each blob's modification time (ns), for :meth:`has` to see a blob written into in place."""
        return {digest: self.blob(digest).stat().st_mtime_ns for digest in manifest.values()}

    def has(self, manifest: dict[str, str], stamps: dict[str, int] | None = None) -> bool:
        """Whether every file of a manifest is in the store, intact.

        A blob whose modification time is not its ``stamps`` entry (an output written into in place
        through its hard link, or a store copied without times) is hashed: if its bytes changed it is
        deleted, and the step that made it counts as a miss and runs again.
        """
        return all(self._intact(digest, (stamps or {}).get(digest)) for digest in manifest.values())

    def _intact(self, digest: str, stamp: int | None) -> bool:
        blob = self.blob(digest)
        try:
            changed = stamp is not None and blob.stat().st_mtime_ns != stamp
        except FileNotFoundError:
            return False
        if changed and sha256_file(blob) != digest:
            blob.unlink(missing_ok=True)
            return False
        return True

    def scratch_dir(self) -> tempfile.TemporaryDirectory:
        """A temporary directory on the same filesystem as the store (so moves are renames)."""
        self.scratch.mkdir(parents=True, exist_ok=True)
        return tempfile.TemporaryDirectory(dir=self.scratch)

    def ingest(self, workdir: Path) -> dict[str, str]:
        """Move every file under ``workdir`` into the store, read-only, leaving ``workdir`` without files (its
        next step's scratch); return {relative path: sha256}."""
        manifest = {}
        for file in _files_under(workdir):
            digest = sha256_file(file)
            target = self.blob(digest)
            if target.exists():
                file.unlink()  # stored already; ``workdir`` is left without files
            else:
                file.chmod(_READ_ONLY)
                try:
                    os.replace(file, target)
                except FileNotFoundError:  # the blob's shard folder is new
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(file, target)
            manifest[file.relative_to(workdir).as_posix()] = digest
        return manifest

    def materialise(self, manifest: dict[str, str]) -> None:
        """Put each blob at its path under the project root, atomically, unless already current: a hard
        link to the blob, or a copy where no link can be made (another file system, the link limit)."""
        for rel, digest in manifest.items():
            target, blob = self.root / rel, self.blob(digest)
            if target.is_file() and _current(target, blob, digest):
                continue
            with atomic_path(target) as tmp:
                try:
                    os.link(blob, tmp)
                except OSError:
                    shutil.copyfile(blob, tmp)
            # Just linked or copied from the blob: its digest is known, settled or not.
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
