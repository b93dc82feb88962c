"""DELLA's compiled CPU kernels (``cpu_kernels.della_merge``, ``della_keep``) against the eager code: bit for bit,
and to rounding with ``rescale: l1`` (whose L1 norms are summed in another order)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import mergeflow.merge.della as della
from mergeflow.merge import merge
from mergeflow.merge.engine import TensorInputs
from mergeflow.merge.sparsify import disjoint_mean
from mergeflow.merge.streaming import merge_files
from mergeflow.merge.sums import running_sum
from mergeflow.schema.merge import DellaOptions

_COMBINES = {"della": "agreeing_mean", "della_linear": "sum"}


def _eager(x: TensorInputs, options: DellaOptions, method: str) -> torch.Tensor:
    """The eager code: every row argsorted, drawn through ``bernoulli_draws``, then combined in torch."""
    tasks = della.prune_(x.stacked().double() - x.base.double(), options, x.name)
    combined = disjoint_mean(tasks, overwrite=True) if _COMBINES[method] == "agreeing_mean" else running_sum(tasks)
    return x.base.double() + options.scaling * combined


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, signed zeros included; a NaN equals any NaN (which operand's NaN an addition keeps, and so
    its sign, is the compiler's choice)."""
    nan = a.isnan()
    if a.shape != b.shape or not torch.equal(nan, b.isnan()):
        return False
    return torch.equal(a[~nan].view(torch.int64), b[~nan].view(torch.int64))


def _rows(
    shape: tuple[int, ...], kind: str, dtype: torch.dtype, generator: torch.Generator, clients: int = 3
) -> TensorInputs:
    base = torch.randn(shape, generator=generator).to(dtype)
    tensors = []
    for _ in range(clients):
        change = torch.randn(shape, generator=generator) * 0.01
        flat = change.view(-1)
        if kind == "ties":  # equal magnitudes, ranked by index
            change = change.round(decimals=2)
        elif kind == "zeros":  # unchanged entries: a bucket of exact zeros
            flat[: flat.numel() // 2] = 0
        elif kind == "skewed" and flat.numel():  # one outlier, the rest in the first keys: a wide row merge-sorted
            flat[0] = 1e3
        elif kind == "nonfinite" and flat.numel():  # NaN ranks last, inf below it, as torch's argsort
            flat[-1], flat[flat.numel() // 3] = math.nan, math.inf
        elif kind == "unchanged":  # every entry zero: ranked by index alone
            flat.zero_()
        if kind == "subnormal":  # float64 task vectors too small for the keys' scale: merge-sorted instead
            tensors.append(torch.zeros(shape, dtype=torch.float64) + change.double() * 1e-310)
            continue
        tensors.append((base.double() + change.double()).to(dtype))
    if kind == "subnormal":
        base = torch.zeros(shape, dtype=torch.float64)
    return TensorInputs(name="w", tensors=tensors, weights=torch.full((clients,), 1 / clients), base=base)


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "skewed", "nonfinite", "unchanged", "subnormal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_della_equals_the_eager_code(kind, dtype):
    """Matrices, vectors (one row), conv kernels (a row per output channel) and rows of one entry, with each
    rescale, ε = 0, and ε up to 1 − density: the same bits, NaNs and signed zeros included; with ``l1`` the
    same to rounding (the norms' sums), the same entries kept."""
    generator = torch.Generator().manual_seed(0)
    for shape in [(7, 50), (300,), (4, 3, 2, 2), (5, 1), (2, 3000), (0, 5), (5, 0), (0,)]:
        x = _rows(shape, kind, dtype, generator)
        for options in [{}, {"rescale": "l1"}, {"rescale": "none"}, {"epsilon": 0.0},
                        {"density": 0.7, "epsilon": 0.3, "scaling": 0.6}]:  # fmt: skip
            parsed = DellaOptions(**options)
            for method in _COMBINES:
                got, eager = getattr(della, method)(x, parsed), _eager(x, parsed, method)
                if parsed.rescale == "l1":
                    torch.testing.assert_close(got, eager, rtol=1e-12, atol=1e-15, equal_nan=True)
                    assert torch.equal(got == x.base.double(), eager == x.base.double())  # dropped alike
                else:
                    assert _same_bits(got, eager), (shape, kind, dtype, options, method)


@pytest.mark.parametrize("clients", [1, 5])
def test_the_compiled_della_with_one_or_five_clients_and_a_long_vector(clients):
    """One row of 2²⁰ + 3 entries (wider than a block) and a matrix, for K = 1 and K = 5."""
    generator = torch.Generator().manual_seed(3)
    for shape in [((1 << 20) + 3,), (33, 70)]:
        x = _rows(shape, "normal", torch.float32, generator, clients)
        for method in _COMBINES:
            assert _same_bits(getattr(della, method)(x, DellaOptions()), _eager(x, DellaOptions(), method)), method


def test_the_compiled_della_splits_rows_between_threads_with_the_same_bits(monkeypatch):
    """Each thread skips every client's stream to its first row; four threads give one thread's bits, the
    keep flags' stream (``rescale: l1``) split in the middle of a client's rows."""
    generator = torch.Generator().manual_seed(1)
    x = _rows((40, 64), "normal", torch.float32, generator)
    alone = {method: getattr(della, method)(x, DellaOptions()) for method in _COMBINES}
    l1 = della.della(x, DellaOptions(rescale="l1"))
    monkeypatch.setattr(della, "_PER_THREAD", 64 * 3)  # 3 rows a thread at least
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # 120 rows of the three clients' stream: 30 a thread
    try:
        for method, expected in alone.items():
            assert _same_bits(getattr(della, method)(x, DellaOptions()), expected)
        assert _same_bits(della.della(x, DellaOptions(rescale="l1")), l1)
    finally:
        torch.set_num_threads(threads)


def test_rows_too_wide_for_the_kernels_scratch_go_to_the_eager_code(monkeypatch):
    """The kernel orders in int32, so a row wider than ``_COMPILED_WIDEST`` is merged by the eager code."""
    generator = torch.Generator().manual_seed(2)
    x = _rows((6, 40), "normal", torch.float32, generator)
    compiled, calls = della._compiled, []
    monkeypatch.setattr(della, "_compiled", lambda *a: calls.append(a) or compiled(*a))
    monkeypatch.setattr(della, "_COMPILED_WIDEST", 40)
    assert _same_bits(della.della(x, DellaOptions()), _eager(x, DellaOptions(), "della"))
    assert calls  # 40 wide: compiled
    monkeypatch.setattr(della, "_COMPILED_WIDEST", 39)
    monkeypatch.setattr(della, "_compiled", lambda *_: pytest.fail("a row wider than the kernel takes was compiled"))
    assert _same_bits(della.della(x, DellaOptions()), _eager(x, DellaOptions(), "della"))


def test_della_streamed_from_float32_files_equals_della_in_memory(tmp_path):
    """The streamed merge hands the kernel the files' float32 tensors as stored, whole, with reused memory."""
    generator = torch.Generator().manual_seed(2)
    base = {"a.weight": torch.randn(30, 40, generator=generator), "b.bias": torch.randn(17, generator=generator),
            "c.empty": torch.zeros(0, 3)}  # fmt: skip
    states = [{k: v + 0.1 * torch.randn(v.shape, generator=generator) for k, v in base.items()} for _ in range(3)]
    save_file(base, str(tmp_path / "base.safetensors"))
    for k, state in enumerate(states):
        save_file(state, str(tmp_path / f"m{k}.safetensors"))
    paths = [tmp_path / f"m{k}.safetensors" for k in range(3)]
    for method in _COMBINES:
        out = tmp_path / f"{method}.safetensors"
        merge_files(method, paths, out, base=tmp_path / "base.safetensors", density=0.6, epsilon=0.2, seed=5)
        in_memory = merge(method, states, base=base, density=0.6, epsilon=0.2, seed=5)
        streamed = load_file(str(out))
        for key, value in in_memory.items():
            assert _same_bits(streamed[key].double(), value.to(torch.float32).double()), (method, key)
