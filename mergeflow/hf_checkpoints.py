"""Hugging Face model directories as streaming inputs and outputs.

A directory holds ``model.safetensors`` or shards listed in ``model.safetensors.index.json``
(``weight_map``: tensor name -> shard file), beside ``config.json`` and tokenizer files.
``open_checkpoint`` reads such a directory, or a single safetensors file, tensor by tensor;
``ShardedWriter`` writes the shards and index as ``save_pretrained`` does; ``atomic_dir``
publishes a finished directory with one rename.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from huggingface_hub.serialization import split_state_dict_into_shards_factory

from mergeflow.errors import MergeflowError
from mergeflow.safetensors_io import SafetensorsFile, SafetensorsWriter, TensorEntry, itemsize

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# transformers 5 saves with 50GB shards; 5GB keeps every file under the Hub's recommended size, as mergekit does.
MAX_SHARD_SIZE = "5GB"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
)
Layout = Mapping[str, tuple[str, tuple[int, ...]]]


class Checkpoint(Mapping[str, torch.Tensor]):
    """The tensors of one safetensors file or Hugging Face model directory, each read when used.

    Keys iterate in storage order (shard, then offset), so one pass reads every file front to back.
    """

    def __init__(self, path: Path, where: dict[str, SafetensorsFile], directory: Path | None) -> None:
        self.path = path
        self.directory = directory
        files = list(dict.fromkeys(where.values()))
        order = sorted(where, key=lambda key: (files.index(where[key]), where[key].entries[key].start))
        self._where = {key: where[key] for key in order}
        self._files = files

    def entry(self, key: str) -> TensorEntry:
        """Dtype, shape and location of tensor ``key`` (no data read)."""
        return self._where[key].entries[key]

    def read_into(self, key: str, buffer: memoryview, offset: int = 0) -> None:
        """Fill ``buffer`` with tensor ``key``'s bytes from ``offset`` on."""
        self._where[key].read_into(key, buffer, offset)

    def array(self, key: str) -> np.ndarray:
        """Float32 or float64 tensor ``key``, read-only, over its file's memory map (``SafetensorsFile.array``)."""
        return self._where[key].array(key)

    def __getitem__(self, key: str) -> torch.Tensor:
        entry = self.entry(key)
        tensor = torch.empty(entry.shape, dtype=entry.torch_dtype)
        self.read_into(key, memoryview(tensor.view(-1).view(torch.uint8).numpy()))
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        """Close the files."""
        for file in self._files:
            file.close()


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a safetensors file or a Hugging Face model directory (single or sharded) for streaming."""
    path = Path(path)
    if path.is_file():
        file = SafetensorsFile(path)
        return Checkpoint(path, dict.fromkeys(file.entries, file), None)
    if not path.is_dir():
        raise MergeflowError(f"{path}: checkpoint not found")
    if (path / INDEX).is_file():
        return Checkpoint(path, _open_shards(path / INDEX), path)
    if (path / WEIGHTS).is_file():
        file = SafetensorsFile(path / WEIGHTS)
        return Checkpoint(path, dict.fromkeys(file.entries, file), path)
    raise MergeflowError(f"{path}: no {WEIGHTS} or {INDEX}: not a Hugging Face model directory with safetensors")


def _open_shards(index: Path) -> dict[str, SafetensorsFile]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise MergeflowError(f"{index}: not a readable safetensors index ({error})") from None
    files: dict[str, SafetensorsFile] = {}
    try:
        for name in dict.fromkeys(weight_map.values()):
            if not (index.parent / name).is_file():
                raise MergeflowError(f"{index}: names shard {name}, which is missing")
            files[name] = SafetensorsFile(index.parent / name)
        for key, name in weight_map.items():
            if key not in files[name].entries:
                raise MergeflowError(f"{index.parent / name}: has no tensor {key!r}, which {index.name} maps to it")
    except MergeflowError:
        for file in files.values():
            file.close()
        raise
    return {key: files[name] for key, name in weight_map.items()}


class ShardedWriter:
    """Writes a layout into a directory as ``save_pretrained`` does: ``model.safetensors``, or shards of at most
    ``max_shard_size`` (a tensor larger than that gets a shard of its own) and ``model.safetensors.index.json``."""

    def __init__(self, directory: Path, layout: Layout, metadata: Mapping[str, str], max_shard_size: int | str) -> None:
        sizes = {key: math.prod(shape) * itemsize(dtype) for key, (dtype, shape) in layout.items()}
        try:
            self._split = split_state_dict_into_shards_factory(
                sizes, get_storage_size=int, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
            )
        except ValueError as error:
            raise MergeflowError(f"max_shard_size {max_shard_size!r}: {error}") from None
        self._directory = directory
        self._layout = layout
        self._metadata = {"format": "pt", **metadata}
        self._shards = list(self._split.filename_to_tensors.items())
        self._shard_of = {key: i for i, (_, keys) in enumerate(self._shards) for key in keys}
        # A tensor larger than a shard gets its shard ahead of the smaller tensors before it.
        self.order = [key for _, keys in self._shards for key in keys]
        self._current = -1
        self._stream = None
        self._writer: SafetensorsWriter | None = None

    def write(self, key: str, data: memoryview) -> None:
        """Append bytes of tensor ``key``; tensors come in ``order``, each in one or more parts."""
        while self._current < self._shard_of[key]:
            self._next_shard()
        assert self._writer is not None
        self._writer.write(key, data)

    def _next_shard(self) -> None:
        self._close_shard()
        self._current += 1
        name, keys = self._shards[self._current]
        self._stream = (self._directory / name).open("wb", buffering=0)
        self._writer = SafetensorsWriter(self._stream, {key: self._layout[key] for key in keys}, self._metadata)

    def _close_shard(self) -> None:
        if self._writer is not None:
            self._writer.finish()
            self._writer = None
        self.close()

    def finish(self) -> None:
        """Write the shards left (tensors with no data) and the index of a sharded output."""
        while self._current < len(self._shards) - 1:
            self._next_shard()
        self._close_shard()
        if self._split.is_sharded:
            index = {"metadata": self._split.metadata, "weight_map": self._split.tensor_to_filename}
            (self._directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    def close(self) -> None:
        """Close the open shard file, if any (after an error too)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def copy_model_files(source: Path, target: Path, dtype: torch.dtype | None = None) -> None:
    """Copy config, generation config and tokenizer files from ``source``; record ``dtype`` in the config if given."""
    for name in MODEL_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    config = target / "config.json"
    if dtype is not None and config.is_file():
        data = json.loads(config.read_text())
        for key in ("dtype", "torch_dtype"):
            if key in data:
                data[key] = str(dtype).removeprefix("torch.")
        config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temp directory beside ``path``; on success it replaces ``path``, so a kill leaves no partial output."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    old = tmp.with_name(tmp.name + ".old")
    try:
        yield tmp
        tmp.chmod(0o755)
        if path.exists():  # a directory cannot be renamed over a non-empty one: move the old output aside first
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        for leftover in (tmp, old):
            if leftover.is_dir():
                shutil.rmtree(leftover)
            elif leftover.exists():
                leftover.unlink()
