"""Safetensors files read and written tensor by tensor, without loading a whole file.

Reads go through ``os.preadv`` straight into the caller's buffer, at the offsets in the
file's header: one copy from the page cache, no intermediate ``bytes``. Nothing is
memory-mapped: pages of a mapped file stay resident while it is open, so K open models
would count K models of memory even though each tensor is used once.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from mergeflow.errors import MergeflowError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODES = {dtype: code for code, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in its file: dtype code, shape and absolute byte range."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        """The tensor's torch dtype."""
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        """The number of elements."""
        return math.prod(self.shape)


def itemsize(code: str) -> int:
    """Bytes per element of a safetensors dtype code."""
    return DTYPES[code].itemsize


class SafetensorsFile:
    """One safetensors file, open for positional reads; its header parsed and checked against its size."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            size = path.stat().st_size
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > size - 8:
                    raise ValueError("header length beyond the end of the file")
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error, UnicodeDecodeError) as error:
            raise MergeflowError(f"{path}: not a readable safetensors file ({error})") from None
        if not isinstance(header, dict):
            raise MergeflowError(f"{path}: not a readable safetensors file (the header is not a JSON object)")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries = {key: self._entry(key, value, 8 + length, size) for key, value in header.items()}
        self._fd = os.open(path, os.O_RDONLY)
        self._map: mmap.mmap | None = None

    def _entry(self, key: str, value: object, data_start: int, size: int) -> TensorEntry:
        try:
            dtype, shape, (start, end) = value["dtype"], tuple(value["shape"]), value["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise MergeflowError(f"{self.path}: malformed header entry for tensor {key!r}") from None
        if dtype not in DTYPES:
            raise MergeflowError(f"{self.path}: tensor {key!r} has dtype {dtype}, which cannot be merged")
        entry = TensorEntry(dtype, shape, data_start + start, end - start)
        if entry.nbytes != entry.numel * itemsize(dtype):
            raise MergeflowError(f"{self.path}: tensor {key!r} has {entry.nbytes} bytes for shape {list(shape)}")
        if entry.start + entry.nbytes > size:
            raise MergeflowError(f"{self.path}: truncated safetensors file (tensor {key!r} ends beyond the file)")
        return entry

    def read_into(self, key: str, buffer: memoryview, offset: int = 0) -> None:
        """Fill ``buffer`` with the tensor's bytes from ``offset`` (bytes into the tensor) on."""
        entry = self.entries[key]
        if offset + len(buffer) > entry.nbytes:
            raise ValueError(f"read past the end of tensor {key!r}")
        done = 0
        while done < len(buffer):
            got = os.preadv(self._fd, [buffer[done:]], entry.start + offset + done)
            if got == 0:
                raise MergeflowError(f"{self.path}: truncated safetensors file (tensor {key!r})")
            done += got

    def array(self, key: str) -> np.ndarray:
        """A float32 or float64 tensor's stored elements as a read-only array over a memory map of the file:
        nothing is read until used, and then straight from the page cache, without a copy."""
        entry = self.entries[key]
        if self._map is None:
            # read-only: a copy-on-write map is charged in full against memory, and one larger than RAM and
            # swap is refused (ENOMEM), where a read-only one of any size is not
            self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        dtype = np.dtype(str(entry.torch_dtype).removeprefix("torch."))
        return np.frombuffer(self._map, dtype=dtype, count=entry.numel, offset=entry.start)

    def close(self) -> None:
        """Close the file."""
        self._map = None  # unmapped once no array over it is left
        os.close(self._fd)


class SafetensorsWriter:
    """Writes a safetensors file in the order of a layout fixed in advance, a tensor or part of one at a time."""

    def __init__(
        self, stream: BinaryIO, layout: Mapping[str, tuple[str, tuple[int, ...]]], metadata: Mapping[str, str]
    ) -> None:
        self._stream = stream
        header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        self._ranges = {}
        for key, (dtype, shape) in layout.items():
            size = math.prod(shape) * itemsize(dtype)
            header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._ranges[key] = (offset, offset + size)
            offset += size
        self._size = offset
        self._written = 0
        self.order = list(layout)
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        _write_all(stream, struct.pack("<Q", len(encoded)) + encoded)

    def write(self, key: str, data: memoryview) -> None:
        """Append bytes of tensor ``key``; tensors come in the layout's order, each in one or more parts."""
        start, end = self._ranges[key]
        if not start <= self._written <= self._written + len(data) <= end:
            raise ValueError(f"tensor {key!r} written out of order or past its size")
        _write_all(self._stream, data)
        self._written += len(data)

    def finish(self) -> None:
        """Check that every tensor was written in full."""
        if self._written != self._size:
            raise ValueError(f"wrote {self._written} bytes of tensor data, the header says {self._size}")


_WRITE_CHUNK = 1 << 20  # bytes a write call takes at most


def _write_all(stream: BinaryIO, data: bytes | memoryview) -> None:
    # In chunks of 1 MiB: a streamed DELLA merge of GPT-2 (500 MB out, tensors up to 154 MB) spent 0.13-1.02 s
    # (mostly 0.6-0.9) writing whole tensors in one call each, 0.68-0.98 s in 16 MiB calls, 0.12-0.52 s in
    # 4 MiB ones and 0.13-0.18 s in 1 MiB ones (ext4's page cache on this project's 2-core VM).
    view = memoryview(data).cast("B")
    while view:
        view = view[stream.write(view[:_WRITE_CHUNK]) :]
