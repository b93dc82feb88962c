"""Compile the CPU merge kernels before a user's first merge: ``python -m mergeflow.merge.warm``, which
``make install`` runs. numba compiles a kernel for each set of argument types it meets and caches it on disk
(beside ``mergeflow/merge/cpu_kernels.py``, or under ``NUMBA_CACHE_DIR``); cold, a first TIES or DELLA merge of
GPT-2 files spent about 9 s a method compiling (``bench/first_merge.py``, docs/benchmarks.md). Merging small
stand-ins with every sparsifying method, in memory and streamed from files, in float32, bfloat16 and float64,
meets every type a merge of up to 8 clients uses (``cpu_kernels.padded``), so later merges load the kernels
(about 0.5 s) instead.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

_STORED = (torch.float32, torch.bfloat16, torch.float64)
_MERGES = (
    ("ties", {"density": 0.5}),
    ("dare_ties", {"drop_rate": 0.5}),
    ("breadcrumbs", {}),
    ("della", {"density": 0.5}),
    ("della", {"density": 0.5, "rescale": "l1"}),
)


def _stand_ins(dtype: torch.dtype, count: int) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """A base and ``count`` clients with a matrix and a vector each (DELLA prunes a matrix by rows); the matrix is
    as large as large tensors are where it matters: over 2¹⁶ entries, so the selections bracket their cuts from a
    sample, and over 2²⁰ (``streaming.STORED_BLOCK``), so a streamed merge takes it in blocks."""
    generator = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(1280, 1024, generator=generator), "b": torch.randn(32, generator=generator)}
    clients = [{k: v + 0.1 * torch.randn(v.shape, generator=generator) for k, v in base.items()} for _ in range(count)]
    return {k: v.to(dtype) for k, v in base.items()}, [{k: v.to(dtype) for k, v in c.items()} for c in clients]


def warm_kernels(count: int = 2) -> list[str]:
    """Merge stand-ins of ``count`` clients with every method that runs compiled CPU kernels, each stored dtype,
    in memory and streamed; returns one line per merge with its time (the compile, the first time)."""
    from safetensors.torch import save_file

    from mergeflow.merge import merge
    from mergeflow.merge.streaming import merge_files

    lines = []
    with tempfile.TemporaryDirectory() as folder:
        for dtype in _STORED:
            base, clients = _stand_ins(dtype, count)
            paths = [Path(folder) / f"client_{k}.safetensors" for k in range(count)]
            for path, state in zip(paths, clients, strict=True):
                save_file(state, str(path))
            save_file(base, str(Path(folder) / "base.safetensors"))
            for method, options in _MERGES:
                started = time.perf_counter()
                merge(method, clients, base=base, **options)
                merge_files(method, paths, Path(folder) / "out.safetensors", base=Path(folder) / "base.safetensors",
                            **options)  # fmt: skip
                elapsed = time.perf_counter() - started
                lines.append(f"{method} {options} {str(dtype).removeprefix('torch.')}: {elapsed:.1f} s")
    return lines


if __name__ == "__main__":
    started = time.perf_counter()
    for line in warm_kernels():
        print(f"mergeflow: compiled {line}", flush=True)
    print(f"mergeflow: the CPU merge kernels are compiled ({time.perf_counter() - started:.0f} s)")
