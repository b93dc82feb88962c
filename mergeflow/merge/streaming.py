"""Streaming merges of safetensors files and Hugging Face model directories, at about disk speed.

``merge_files`` reads each tensor of the K inputs once (twice for the mask and Gram methods below),
with ``os.preadv`` at the header's offsets straight into preallocated buffers, in a reader thread
that runs ahead of the merge, and writes the merged tensors into the output as they are done:

- Elementwise methods (``average``, ``weighted``, ``task_arithmetic``, ``fisher``) merge
  blocks of ``BLOCK`` elements. Each input block is widened to float64 in a reused buffer and
  the registered method sums the K blocks in place (``mergeflow.merge.sums``); the float64
  result is rounded once to the output dtype. Anonymous memory stays near the buffers' few
  MiB whatever the models' size (measured in docs/benchmarks.md).
- Methods with per-client masks (``ties``, ``dare_*``, ``breadcrumbs*``) first draw each tensor's
  K masks from its whole task vectors (``_Masks``: K booleans per element; on the CPU the compiled
  kernels of ``mergeflow.merge.cpu_kernels`` read the clients' float32/float64 tensors through
  memory maps, elsewhere one float64 task vector at a time and its top-k temporaries), then merge
  blocks like the elementwise methods. On the CPU, where a tensor's inputs are all float32 or all
  float64, those blocks (``STORED_BLOCK`` elements) are views of the memory maps as stored, which the
  method widens itself (``MergeMethod.stored``) on every core: nothing is read ahead. Its
  result goes straight into the output buffer when that is float32 or float64.
- Methods that read a tensor only through the Gram matrix of its K inputs or task vectors
  (``model_stock``, ``slerp``) take two passes over its blocks: the first sums the K × K Gram, the
  second merges blocks like the elementwise methods. Each such tensor is read twice, never held whole.
- Other tensor-scope methods (``tsv``, ``iso_c``, ``iso_cts``, ``della*``) take each tensor whole: its
  K float64 copies in buffers, or, for a method that takes its tensors as stored (DELLA, on the CPU),
  the memory maps' views of the whole tensor.

On a GPU (``device="cuda"``) the reader thread reads each block's bytes into pinned host memory
and copies them to the GPU, where they are widened to float64 and merged; the merged block comes
back in the output dtype. Blocks are ``DEVICE_BLOCK`` elements (a kernel launch per 128K elements
would leave the GPU idle), masks are drawn and Grams summed on the GPU, and reading the next block
overlaps the GPU's work on this one.

Inputs and the output are single ``.safetensors`` files or Hugging Face model directories
(``mergeflow.hf_checkpoints``). The output is written to a temp file or directory and renamed,
so a kill leaves no partial output.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, closing, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel

from mergeflow import cancel
from mergeflow.device import resolve_device
from mergeflow.errors import MergeflowError
from mergeflow.files import atomic_path
from mergeflow.hf_checkpoints import (
    MAX_SHARD_SIZE,
    Checkpoint,
    ShardedWriter,
    atomic_dir,
    copy_model_files,
    open_checkpoint,
)
from mergeflow.merge.engine import (
    Implementation,
    TaskOperands,
    TaskVectors,
    TensorInputs,
    fisher_norms,
    gram_matrix,
    implementations,
    normalized_weights,
    parsed_options,
    require_inputs,
    tensor_method,
)
from mergeflow.merge.reader import Reader
from mergeflow.safetensors_io import CODES, DTYPES, SafetensorsWriter
from mergeflow.schema.merge import DECLARED, MergeMethod

# Elements per block for elementwise methods: K float64 input rows of 1 MiB stay in cache while
# they are summed; 64K-256K measured fastest on the 2-core bench machine (2 MiB L2 per core).
BLOCK = 1 << 17
# Elements per block on an accelerator: K float64 blocks of 128 MiB each, few launches per tensor.
DEVICE_BLOCK = 1 << 24
# Elements per block merged from the files as stored (nothing read ahead), split between threads.
STORED_BLOCK = 1 << 20
_DTYPE_NAMES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class _Item:
    """One step of the merge: a block of a tensor's elements, or a whole tensor; method None copies model 0's."""

    key: str
    method: MergeMethod | None
    start: int
    shape: tuple[int, ...]
    total: tuple[int, ...] = ()  # the whole tensor's shape
    gram_pass: bool = False  # a block read only to sum the tensor's Gram matrix (``MergeMethod.gram``)
    stored: bool = False  # merged from views of the files as stored (``MergeMethod.stored``), not read

    @property
    def count(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class _Inputs:
    """What one merge reads: the K models, the base and the K Fishers (those the method uses)."""

    models: list[Checkpoint]
    base: Checkpoint | None
    fishers: list[Checkpoint] | None

    def used(self, method: MergeMethod) -> tuple[Checkpoint | None, list[Checkpoint] | None]:
        """The base and the Fishers if ``method`` uses them."""
        return (
            self.base if "base" in method.uses else None,
            self.fishers if "fishers" in method.uses else None,
        )

    def itemsize(self) -> int:
        """The widest element of any input tensor, in bytes."""
        everything = [*self.models, *([self.base] if self.base else []), *(self.fishers or [])]
        return max((c.entry(key).torch_dtype.itemsize for c in everything for key in c), default=1)


class _Staging:
    """Bytes on their way from a file to float64 on the merge's device: a host buffer to read into
    (pinned when bound for a GPU) and, for an accelerator, its copy there, widened on the device."""

    def __init__(self, size: int, device: torch.device) -> None:
        accelerated = device.type != "cpu"
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=accelerated and device.type == "cuda")
        self.device = torch.empty(size, dtype=torch.uint8, device=device) if accelerated else None

    def read(self, checkpoint: Checkpoint, key: str, start: int, count: int, out: torch.Tensor) -> None:
        """Elements ``start:start + count`` of ``key`` into ``out`` (float64, on the merge's device)."""
        dtype = checkpoint.entry(key).torch_dtype
        raw = self.host[: count * dtype.itemsize]
        checkpoint.read_into(key, memoryview(raw.numpy()), start * dtype.itemsize)
        if self.device is not None:  # move the bytes, then widen there: a CPU-to-GPU copy would widen on the CPU
            raw = self.device[: raw.numel()]
            raw.copy_(self.host[: raw.numel()])  # blocking: the host buffer is free for the next read after
        out.copy_(raw.view(dtype))


class _Buffers:
    """One item's float64 inputs: the K models in one ``(K, n)`` buffer, the base, the K Fishers in another."""

    def __init__(self, capacity: int, count: int, base: bool, fishers: bool, device: torch.device) -> None:
        wide = {"dtype": torch.float64, "device": device}
        self.models = torch.empty(count * capacity, **wide)
        self.base = torch.empty(capacity, **wide) if base else None
        self.fishers = torch.empty(count * capacity, **wide) if fishers else None


def merge_files(
    method: str,
    paths: Sequence[str | Path],
    out: str | Path,
    *,
    base: str | Path | None = None,
    weights: Sequence[float] | None = None,
    fishers: Sequence[str | Path] | None = None,
    metadata: Mapping[str, str] | None = None,
    out_dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    device: str | torch.device = "cpu",
    options: BaseModel | None = None,
    **keywords: object,
) -> None:
    """Merge checkpoints into ``out`` with a tensor-scope method, streaming tensor by tensor.

    Each input (models, ``base``, ``fishers``) is a ``.safetensors`` file or a Hugging Face model
    directory, sharded or not. ``out`` ending in ``.safetensors`` is written as one file; any other
    ``out`` becomes a model directory: shards of at most ``max_shard_size`` (``"5GB"``, or bytes)
    with an index when more than one, ``config.json`` and tokenizer files copied from the first
    model when it is a directory. Tensors keep the first model's dtype (bf16 stays bf16) unless
    ``out_dtype`` (e.g. ``"float32"``) is given for the floating ones.

    Example: ``merge_files("ties", ["ft-a", "ft-b"], "merged", base="gpt2", density=0.2)``.
    Model-scope methods (``exact``, ``ssf``, ``regmean``) couple all parameters and need the
    whole models: use ``mergeflow.merge.merge`` for them. ``device`` (``"cuda"``, ``"auto"``) merges
    on an accelerator; the files are still read and written on the host. The method's options are ``options``,
    its validated options model, or ``keywords`` (as ``mergeflow.merge.engine.run_merge``'s).
    """
    declaration = DECLARED.lookup(method)
    if declaration.scope != "tensor":
        raise MergeflowError(f"merge method {method!r} couples all parameters and cannot stream; use merge()")
    if not paths:
        raise MergeflowError("merge needs at least one model")
    require_inputs(declaration, {"base": base, "sizes": weights, "fishers": fishers})
    parsed = parsed_options(declaration, options, keywords)
    dtype = _parse_dtype(out_dtype)
    where = resolve_device(device) if isinstance(device, str) else device
    out = Path(out)
    with ExitStack() as stack:
        inputs = _Inputs(
            [_open(stack, p) for p in paths],
            _open(stack, base) if base is not None and "base" in declaration.uses else None,
            [_open(stack, p) for p in fishers] if fishers is not None and "fishers" in declaration.uses else None,
        )
        _check_layouts(inputs)
        layout = {key: _out_layout(inputs.models[0], key, dtype) for key in inputs.models[0]}
        w = normalized_weights(weights, len(inputs.models), where)
        if out.suffix == ".safetensors":
            stream = stack.enter_context(open(stack.enter_context(atomic_path(out)), "wb", buffering=0))
            sink: SafetensorsWriter | ShardedWriter = SafetensorsWriter(stream, layout, dict(metadata or {}))
        else:
            directory = stack.enter_context(atomic_dir(out))
            sink = ShardedWriter(directory, layout, dict(metadata or {}), max_shard_size)
            stack.callback(sink.close)
            if inputs.models[0].directory is not None:
                copy_model_files(inputs.models[0].directory, directory, dtype)
        norms = _on_device(fisher_norms(inputs.fishers), where) if inputs.fishers is not None else None
        # closing(): on an error, stop the reader thread before the files close, not when the generator is collected.
        block = BLOCK if where.type == "cpu" else DEVICE_BLOCK
        items = list(_plan(declaration, inputs, sink.order, block, stored=where.type == "cpu"))
        code = implementations()
        merged = stack.enter_context(closing(_merged(items, inputs, layout, w, norms, parsed, where, code)))
        for key, data in merged:
            sink.write(key, data)
        sink.finish()


def _on_device(norms: Callable[[], torch.Tensor], device: torch.device) -> Callable[[], torch.Tensor]:
    """The Fishers' norms, summed from the files on the host once, on the merge's device."""
    return functools.cache(lambda: norms().to(device))


def _open(stack: ExitStack, path: str | Path) -> Checkpoint:
    checkpoint = open_checkpoint(path)
    stack.callback(checkpoint.close)
    return checkpoint


def _check_layouts(inputs: _Inputs) -> None:
    reference = inputs.models[0]
    for other in [*inputs.models[1:], *([inputs.base] if inputs.base is not None else [])]:
        if set(other) != set(reference):
            different = sorted(set(other) ^ set(reference))[:5]
            raise MergeflowError(f"{other.path}: different tensors from {reference.path}: {', '.join(different)}")
        _check_shapes(reference, other)
    for fisher in inputs.fishers or []:
        if set(fisher) != set(inputs.fishers[0]) or not set(fisher) <= set(reference):
            different = sorted((set(fisher) ^ set(inputs.fishers[0])) | (set(fisher) - set(reference)))[:5]
            raise MergeflowError(f"{fisher.path}: Fisher tensors do not match the models': {', '.join(different)}")
        _check_shapes(reference, fisher)


def _check_shapes(reference: Checkpoint, other: Checkpoint) -> None:
    for key in other:
        if other.entry(key).shape != reference.entry(key).shape:
            raise MergeflowError(
                f"{other.path}: tensor {key!r} has shape {list(other.entry(key).shape)}, "
                f"{reference.path} has {list(reference.entry(key).shape)}: the architectures differ"
            )


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    parsed = _DTYPE_NAMES.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if dtype is not None and parsed not in _DTYPE_NAMES.values():
        raise MergeflowError(f"out_dtype {dtype!r}: not one of {', '.join(_DTYPE_NAMES)}")
    return parsed


def _out_layout(model: Checkpoint, key: str, dtype: torch.dtype | None) -> tuple[str, tuple[int, ...]]:
    entry = model.entry(key)
    floating = entry.torch_dtype.is_floating_point
    return (CODES[dtype] if dtype is not None and floating else entry.dtype), entry.shape


def _plan(
    declaration: MergeMethod, inputs: _Inputs, order: Sequence[str], block: int, stored: bool = False
) -> Iterator[_Item]:
    """The merge's items in the output's order: elementwise methods and copies in blocks, other methods whole.
    With ``stored`` (the CPU), a method that takes its tensors as stored merges straight from the files
    (blocks of ``STORED_BLOCK``, or whole tensors) where every input of the tensor is float32, or every
    one float64."""
    for key in order:
        entry = inputs.models[0].entry(key)
        method = tensor_method(
            declaration, entry.torch_dtype.is_floating_point, inputs.fishers is None or key in inputs.fishers[0]
        )
        as_stored = method is not None and stored and method.stored and _stored_dtype(inputs, method, key)
        if method is not None and not method.elementwise:
            yield _Item(key, method, 0, entry.shape, entry.shape, stored=as_stored)
            continue
        if as_stored:
            blocks = range(0, max(entry.numel, 1), STORED_BLOCK)
            yield from (
                _Item(key, method, a, (min(STORED_BLOCK, entry.numel - a),), entry.shape, stored=True) for a in blocks
            )
            continue
        blocks = range(0, max(entry.numel, 1), block)
        if method is not None and method.gram:
            yield from (_Item(key, method, a, (min(block, entry.numel - a),), entry.shape, True) for a in blocks)
        for start in blocks:
            yield _Item(key, method, start, (min(block, entry.numel - start),), entry.shape)


def _stored_dtype(inputs: _Inputs, method: MergeMethod, key: str) -> bool:
    """Whether every input of ``key`` that ``method`` reads is float32, or every one float64."""
    base, fishers = inputs.used(method)
    checkpoints = [*inputs.models, *([base] if base is not None else []), *(fishers or [])]
    dtypes = {checkpoint.entry(key).torch_dtype for checkpoint in checkpoints}
    return len(dtypes) == 1 and dtypes <= {torch.float32, torch.float64}


def _merged(
    items: list[_Item],
    inputs: _Inputs,
    layout: Mapping[str, tuple[str, tuple[int, ...]]],
    weights: torch.Tensor,
    norms: Callable[[], torch.Tensor] | None,
    options: BaseModel,
    device: torch.device,
    code: Callable[[MergeMethod], Implementation],
) -> Iterator[tuple[str, memoryview]]:
    """Each item's merged bytes in the output dtype, in order; each view is valid until the next item.
    ``code``: each method's function and masks function (``mergeflow.merge.engine.implementations``)."""
    count = len(inputs.models)
    capacity = max((item.count for item in items if not item.stored), default=0)
    blocks_only = all(item.method is None or item.method.elementwise for item in items)
    # Two buffer sets let the reader run one block ahead; whole tensors get one set, as large as K largest tensors.
    buffer_sets = [
        _Buffers(capacity, count, inputs.base is not None, inputs.fishers is not None, device)
        for _ in range(2 if blocks_only else 1)
    ]
    staging = _Staging(capacity * inputs.itemsize(), device)
    largest = max((item.count for item in items), default=0)
    out_size = largest * max(DTYPES[code].itemsize for code, _ in layout.values())
    out = torch.empty(out_size, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def fill(item: _Item, buffers: _Buffers) -> None:
        if item.method is None or item.stored:
            return
        base, fishers = inputs.used(item.method)
        n = item.count
        for k, model in enumerate(inputs.models):
            staging.read(model, item.key, item.start, n, buffers.models[k * n : (k + 1) * n])
        if base is not None:
            staging.read(base, item.key, item.start, n, buffers.base[:n])
        for k, fisher in enumerate(fishers or []):
            staging.read(fisher, item.key, item.start, n, buffers.fishers[k * n : (k + 1) * n])

    masks = _Masks(inputs, items, options, device, code)
    # a stored item's float64 result and scratch, made once: new ones per item cost a page fault per 4 KiB
    stored_size = max((item.count for item in items if item.stored), default=0)
    stored_out = functools.cache(lambda: torch.empty(stored_size, dtype=torch.float64, device=device))
    scratch = _Scratch(device)
    grams: dict[str, torch.Tensor] = {}
    threads_before = torch.get_num_threads()
    # Blocks: the merge on one thread and the reader on one, each on its own core; whole tensors: all of them.
    threads = _intra_op_threads(1) if blocks_only else nullcontext()
    reader_threads = functools.partial(_torch_threads, 1 if blocks_only else threads_before)
    with threads, Reader(items, fill, buffer_sets, reader_threads) as reader:
        for item, buffers in reader:
            cancel.check()
            if item.gram_pass:
                assert item.method is not None and item.method.gram is not None
                stack = buffers.models[: count * item.count].view(count, item.count)
                block_gram = gram_matrix(stack, buffers.base[: item.count] if buffers.base is not None else None,
                                         item.method.gram)  # fmt: skip
                grams[item.key] = grams[item.key] + block_gram if item.start else block_gram
                reader.release(buffers)
                continue
            dtype = DTYPES[layout[item.key][0]]
            target = out[: item.count * dtype.itemsize]
            if item.method is None:
                inputs.models[0].read_into(item.key, memoryview(target.numpy()), item.start * dtype.itemsize)
            else:
                if item.method.masks is not None and item.start == 0:
                    with _intra_op_threads(threads_before):  # whole-tensor work (top-k): every core
                        masks.draw(item)
                item_masks = masks.block(item) if item.method.masks is not None else None
                if item.stored:  # nothing read ahead: the merge takes every core
                    # a float32 or float64 result straight into the output (rounded once, as a copy would)
                    into = target.view(dtype) if dtype in (torch.float32, torch.float64) else stored_out()[: item.count]
                    x = _stored_inputs(item, inputs, weights, norms, item_masks, into, scratch)
                    with _intra_op_threads(threads_before):
                        result = code(item.method).fn(x, options)
                else:
                    x = _tensor_inputs(item, inputs, buffers, weights, norms, item_masks, grams.get(item.key))
                    result = code(item.method).fn(x, options)
                flat = result.reshape(-1)
                if flat.device != target.device:  # narrowed on the device: half the bytes come back
                    flat = flat.to(dtype)
                if flat.data_ptr() != target.data_ptr():  # not merged into the output itself
                    target.view(dtype).copy_(flat)
            reader.release(buffers)
            yield item.key, memoryview(target.numpy())


class _Scratch:
    """Float64 working memory for stored items (``TensorInputs.scratch``), kept and grown to the largest asked for."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._memory = torch.empty(0, dtype=torch.float64, device=device)

    def __call__(self, count: int) -> torch.Tensor:
        if count > self._memory.numel():
            self._memory = torch.empty(0, dtype=torch.float64, device=self._device)  # the old one freed first
            self._memory = torch.empty(count, dtype=torch.float64, device=self._device)
        return self._memory[:count]


def _torch_threads(count: int) -> None:
    """Run this thread's torch ops on ``count`` threads from now on.

    A thread's first parallel op otherwise takes the count another thread set last: the reader, started
    while the merge ran on one thread, took two when the masks were being drawn on every core, and its
    OpenMP worker spun a core away from the merge (measured: 2 s of CPU in a 3.4 s merge).
    """
    torch.get_num_threads()  # torch's per-thread initialisation, which would otherwise override the count later
    torch.set_num_threads(count)


@contextmanager
def _intra_op_threads(count: int) -> Iterator[None]:
    """Run torch ops on ``count`` threads meanwhile, then restore the count.

    Blocks are merged on one thread while the reader converts the next on another core: two
    threads each splitting every block op across the cores measured 1.3-1.6x slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


_MASK_READ_BLOCK = 1 << 20  # elements of a task vector read (and less the base) at a time while drawing masks
_OPERAND_BLOCK = 1 << 18  # elements of a client's tensor read at a time for a compiled mask function (in cache)


class _Masks:
    """The per-client masks of a method with ``masks`` (TIES, DARE), drawn once per tensor before its blocks.

    Each client's tensor is read only when the mask function asks for it (DARE's draws need none). On
    the CPU, when the clients' and the base's dtype is float32 or float64, a compiled mask function
    takes the differences itself from memory maps of the files (``TaskVectors.operands``) and writes
    the masks in place (``TaskVectors.out``); otherwise each task vector is read into one reused
    float64 row, less the base read once. A tensor's masks cost K booleans per element, never K
    float64 copies.
    """

    def __init__(
        self,
        inputs: _Inputs,
        items: Sequence[_Item],
        options: BaseModel,
        device: torch.device,
        code: Callable[[MergeMethod], Implementation],
    ) -> None:
        self._inputs = inputs
        self._options = options
        self._device = device
        self._code = code
        self._capacity = max((math.prod(i.total) for i in items if i.method is not None and i.method.masks), default=0)
        self._current: torch.Tensor | None = None

    # Buffers made on first use, so that a path that needs one does not pay for the others (the compiled
    # masks never make the float64 row).
    @functools.cached_property
    def _masks(self) -> torch.Tensor:
        return torch.empty(len(self._inputs.models) * self._capacity, dtype=torch.bool, device=self._device)

    @functools.cached_property
    def _base(self) -> torch.Tensor:  # the base in its own dtype, as bytes
        return torch.empty(self._capacity * self._inputs.itemsize(), dtype=torch.uint8, device=self._device)

    @functools.cached_property
    def _row(self) -> torch.Tensor:  # one float64 task vector
        return torch.empty(self._capacity, dtype=torch.float64, device=self._device)

    @functools.cached_property
    def _staging(self) -> _Staging:
        # On the CPU a block-sized scratch keeps each block in cache while it is widened and less the base.
        n = self._capacity
        chunk = max(min(n, _MASK_READ_BLOCK) if self._device.type == "cpu" else n, 1)
        return _Staging(chunk * self._inputs.itemsize(), self._device)

    def draw(self, item: _Item) -> None:
        """Draw the masks of ``item``'s tensor (its first block)."""
        assert item.method is not None and self._inputs.base is not None
        draw = self._code(item.method).masks
        assert draw is not None  # drawn for a method with masks only
        shape, count, key = item.total, len(self._inputs.models), item.key
        n = math.prod(shape)
        base_dtype = self._inputs.base.entry(key).torch_dtype
        base_row = self._base[: n * base_dtype.itemsize].view(base_dtype)
        base_read: list[bool] = []

        def base() -> torch.Tensor:  # read once, when first asked for
            if not base_read:
                self._read(self._inputs.base, key, base_row)
                base_read.append(True)
            return base_row.view(shape)

        def task(k: int) -> torch.Tensor:
            row = self._row[:n]
            self._read(self._inputs.models[k], key, row, subtract=base().view(-1))
            return row.view(shape)

        def operands() -> TaskOperands:
            base_array, tensors = self._inputs.base.array(key), [model.array(key) for model in self._inputs.models]

            def chunks(clients: Sequence[int]) -> Iterator[tuple[int, list[np.ndarray], np.ndarray]]:
                for start in range(0, n, _OPERAND_BLOCK):
                    end = start + _OPERAND_BLOCK
                    yield start, [tensors[k][start:end] for k in clients], base_array[start:end]

            return TaskOperands(count, n, lambda k, step: (tensors[k][::step], base_array[::step]), chunks)

        masks = self._masks[: count * n].view(count, n)
        dtypes = {base_dtype, *(model.entry(key).torch_dtype for model in self._inputs.models)}
        raw = self._device.type == "cpu" and len(dtypes) == 1 and base_dtype in (torch.float32, torch.float64)
        tasks = TaskVectors(count, task, self._device, operands=operands() if raw else None, out=masks)
        for k, mask in enumerate(draw(tasks, shape, key, self._options)):
            if mask.data_ptr() != masks[k].data_ptr():  # not written in place (``TaskVectors.out``)
                masks[k].copy_(mask.reshape(-1))
        self._current = masks

    def _read(self, checkpoint: Checkpoint, key: str, out: torch.Tensor, subtract: torch.Tensor | None = None) -> None:
        """``key``'s elements into ``out`` (any dtype) block by block, less ``subtract`` while a block is in cache."""
        staging = self._staging
        chunk = staging.host.numel() // self._inputs.itemsize()
        for start in range(0, out.numel(), chunk):
            part = out[start : start + chunk]
            staging.read(checkpoint, key, start, part.numel(), part)
            if subtract is not None:
                part.sub_(subtract[start : start + part.numel()])

    def block(self, item: _Item) -> torch.Tensor:
        """The masks of ``item``'s block, ``(K, count)``."""
        assert self._current is not None
        return self._current[:, item.start : item.start + item.count]


def _tensor_inputs(
    item: _Item,
    inputs: _Inputs,
    buffers: _Buffers,
    weights: torch.Tensor,
    norms: Callable[[], torch.Tensor] | None,
    masks: torch.Tensor | None = None,
    gram: torch.Tensor | None = None,
) -> TensorInputs:
    assert item.method is not None
    base, fishers = inputs.used(item.method)
    count, n = len(inputs.models), item.count
    stack = buffers.models[: count * n].view(count, *item.shape)
    return TensorInputs(
        name=item.key,
        tensors=list(stack.unbind(0)),
        weights=weights,
        base=buffers.base[:n].view(item.shape) if base is not None else None,
        fishers=list(buffers.fishers[: count * n].view(count, *item.shape).unbind(0)) if fishers is not None else None,
        norms=norms,
        stack=stack,
        masks=masks,
        gram=gram,
    )


def _stored_inputs(
    item: _Item,
    inputs: _Inputs,
    weights: torch.Tensor,
    norms: Callable[[], torch.Tensor] | None,
    masks: torch.Tensor | None,
    out: torch.Tensor,
    scratch: Callable[[int], torch.Tensor],
) -> TensorInputs:
    """A stored item's inputs: views of its block (or whole tensor) in the files' memory maps, in their stored
    dtype, the ``out`` to merge into and ``scratch`` memory."""
    assert item.method is not None
    base, fishers = inputs.used(item.method)
    end = item.start + item.count

    def block(checkpoint: Checkpoint) -> torch.Tensor:
        with warnings.catch_warnings():  # read-only memory, which a stored method never writes (MergeMethod.stored)
            warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
            return torch.from_numpy(checkpoint.array(item.key)[item.start : end]).view(item.shape)

    return TensorInputs(
        name=item.key,
        tensors=[block(model) for model in inputs.models],
        weights=weights,
        base=block(base) if base is not None else None,
        fishers=[block(fisher) for fisher in fishers] if fishers is not None else None,
        norms=norms,
        masks=masks,
        out=out.view(item.shape),
        scratch=scratch,
    )
