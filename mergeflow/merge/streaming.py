"""Streaming merges of safetensors files: one tensor at a time in, one tensor at a time out.

Tensor-scope methods (``average``, ``weighted``, ``task_arithmetic``, ``fisher``) read each
tensor of the K client files only when they merge it (at the offsets of the safetensors header), and the result is
written straight into the output file, whose header is known up front from the inputs'
headers. Peak memory is then about K copies of the largest tensor (in float64), not K
models, as in mergekit. The output is written to a temp file and renamed, so a kill leaves
no partial file.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from mergeflow.checkpoints import atomic_path
from mergeflow.errors import MergeflowError
from mergeflow.merge.registry import METHODS, merged_tensors, normalized_weights, validate_options

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class LazyTensors(Mapping[str, torch.Tensor]):
    """A read-only mapping over one safetensors file that reads a tensor when it is indexed.

    Tensors are read with ``os.pread`` at the offsets in the file's header, not through a
    memory map: pages of a mapped file stay resident while it is open, so K open models
    would count K models of memory even though each tensor is used once.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            if size > path.stat().st_size - 8:
                raise ValueError("header length beyond the end of the file")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        self._header = header
        self._data_start = 8 + size
        self._file = path.open("rb")

    def __getitem__(self, key: str) -> torch.Tensor:
        entry = self._header[key]
        start, end = entry["data_offsets"]
        data = bytearray(os.pread(self._file.fileno(), end - start, self._data_start + start))
        if len(data) != end - start:
            raise MergeflowError(f"{self.path}: truncated safetensors file (tensor {key!r})")
        return torch.frombuffer(data, dtype=_DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self._header)

    def __len__(self) -> int:
        return len(self._header)

    def layout(self, key: str) -> tuple[str, list[int]]:
        """The dtype code and shape of a tensor, from the header (no data read)."""
        return self._header[key]["dtype"], list(self._header[key]["shape"])

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def _open(stack: ExitStack, path: str | Path) -> LazyTensors:
    path = Path(path)
    if not path.is_file():
        raise MergeflowError(f"{path}: checkpoint not found")
    try:
        tensors = LazyTensors(path)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as error:
        raise MergeflowError(f"{path}: not a readable safetensors file ({error})") from None
    stack.callback(tensors.close)
    return tensors


def _check_layouts(files: Sequence[LazyTensors]) -> dict[str, tuple[str, list[int]]]:
    reference = files[0]
    layout = {key: reference.layout(key) for key in reference}
    for other in files[1:]:
        if set(other) != set(layout):
            different = sorted(set(other) ^ set(layout))[:5]
            raise MergeflowError(f"{other.path}: different tensors from {reference.path}: {', '.join(different)}")
        for key, (_, shape) in layout.items():
            if other.layout(key)[1] != shape:
                raise MergeflowError(
                    f"{other.path}: tensor {key!r} has shape {other.layout(key)[1]}, {reference.path} has {shape}: "
                    "the architectures differ"
                )
    return layout


class SafetensorsWriter:
    """Writes a safetensors file tensor by tensor, in the order of a layout fixed in advance."""

    def __init__(self, stream: Any, layout: dict[str, tuple[str, list[int]]], metadata: dict[str, str]) -> None:
        self._stream = stream
        self._order = list(layout)
        self._next = 0
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        self._sizes = {}
        for key, (dtype, shape) in layout.items():
            size = torch.empty((), dtype=_DTYPES[dtype]).element_size()
            for dim in shape:
                size *= dim
            header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            self._sizes[key] = size
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        stream.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Append the next tensor's bytes; tensors must come in the layout's order."""
        if self._next >= len(self._order) or self._order[self._next] != key:
            raise ValueError(f"tensor {key!r} written out of order")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        if len(data) != self._sizes[key]:
            raise ValueError(f"tensor {key!r} has {len(data)} bytes, its header says {self._sizes[key]}")
        self._stream.write(data)
        self._next += 1


def merge_files(
    method: str,
    paths: Sequence[str | Path],
    out: str | Path,
    *,
    base: str | Path | None = None,
    weights: Sequence[float] | None = None,
    fishers: Sequence[str | Path] | None = None,
    metadata: dict[str, str] | None = None,
    **options: object,
) -> None:
    """Merge safetensors checkpoints into ``out`` with a tensor-scope method, streaming.

    Example: ``merge_files("fisher", clients, "merged.safetensors", fishers=fisher_files,
    weights=sizes)``. Model-scope methods (``exact``, ``ssf``) couple all parameters and
    need the whole models: use ``mergeflow.merge.merge`` for them.
    """
    spec = METHODS.get(method)
    if spec is None:
        raise MergeflowError(f"unknown merge method {method!r}; known: {', '.join(METHODS)}")
    if spec.scope != "tensor":
        raise MergeflowError(f"merge method {method!r} couples all parameters and cannot stream; use merge()")
    if not paths:
        raise MergeflowError("merge needs at least one model")
    if "base" in spec.needs and base is None:
        raise MergeflowError(f"merge method {method!r} needs base (base=...)")
    if "fishers" in spec.needs and fishers is None:
        raise MergeflowError(f"merge method {method!r} needs fishers (fishers=...)")
    parsed = validate_options(method, options)
    with ExitStack() as stack:
        states = [_open(stack, p) for p in paths]
        base_state = _open(stack, base) if base is not None and "base" in spec.uses else None
        fisher_states = [_open(stack, p) for p in fishers] if fishers is not None and "fishers" in spec.uses else None
        layout = _check_layouts([*states, base_state] if base_state is not None else states)
        w = normalized_weights(weights, len(states))
        with atomic_path(out) as tmp, open(tmp, "wb") as stream:
            writer = SafetensorsWriter(stream, layout, dict(metadata or {}))
            for key, tensor in merged_tensors(spec, states, base_state, w, fisher_states, parsed):
                writer.write(key, tensor)
