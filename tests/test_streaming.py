"""Streaming merges from safetensors files equal the in-memory merges, and write valid files."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mergeflow.errors import MergeflowError
from mergeflow.merge import merge
from mergeflow.merge.streaming import merge_files


def _write(tmp_path, count: int = 3, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)

    def state():
        return {
            "layer.weight": torch.randn(7, 5, generator=generator).to(dtype),
            "layer.bias": torch.randn(7, generator=generator).to(dtype),
            "steps": torch.tensor([3], dtype=torch.int64),
        }

    states = [state() for _ in range(count)]
    fishers = [
        {k: torch.rand(v.shape, generator=generator).to(dtype) for k, v in s.items() if k != "steps"} for s in states
    ]
    base = state()
    paths, fisher_paths = [], []
    for k, (s, f) in enumerate(zip(states, fishers, strict=True)):
        paths.append(tmp_path / f"client_{k}.safetensors")
        fisher_paths.append(tmp_path / f"fisher_{k}.safetensors")
        save_file(s, str(paths[-1]))
        save_file(f, str(fisher_paths[-1]))
    save_file(base, str(tmp_path / "base.safetensors"))
    return states, fishers, base, paths, fisher_paths


@pytest.mark.parametrize(
    ("method", "extra"),
    [
        ("average", {}),
        ("weighted", {"weights": [1, 2, 3]}),
        ("task_arithmetic", {"scaling": 0.4}),
        ("fisher", {"weights": [1, 2, 3]}),
        ("ties", {"density": 0.3}),
        ("dare_linear", {"drop_rate": 0.5, "seed": 3}),
        ("dare_ties", {"drop_rate": 0.5}),
        ("model_stock", {}),
    ],
)
def test_streaming_merge_equals_the_in_memory_merge(tmp_path, method, extra):
    states, fishers, base, paths, fisher_paths = _write(tmp_path)
    files = {}
    memory = {}
    if method in ("task_arithmetic", "ties", "dare_linear", "dare_ties", "model_stock"):
        files["base"], memory["base"] = tmp_path / "base.safetensors", base
    if method == "fisher":
        files["fishers"], memory["fishers"] = fisher_paths, fishers
    out = tmp_path / "merged.safetensors"
    merge_files(method, paths, out, metadata={"method": method}, **files, **extra)
    expected = merge(method, states, **memory, **extra)
    streamed = load_file(str(out))
    assert streamed.keys() == expected.keys()
    for key in expected:
        assert streamed[key].dtype == expected[key].dtype
        torch.testing.assert_close(streamed[key], expected[key], rtol=0, atol=0)
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"method": method}


def test_streaming_keeps_half_precision_dtypes(tmp_path):
    states, _, _, paths, _ = _write(tmp_path, dtype=torch.bfloat16)
    merge_files("average", paths, tmp_path / "m.safetensors")
    streamed = load_file(str(tmp_path / "m.safetensors"))
    torch.testing.assert_close(streamed["layer.weight"], merge("average", states)["layer.weight"], rtol=0, atol=0)
    assert streamed["layer.weight"].dtype == torch.bfloat16


def test_streaming_refuses_coupled_methods_mismatched_models_and_leaves_no_file(tmp_path):
    _, _, _, paths, fisher_paths = _write(tmp_path)
    out = tmp_path / "m.safetensors"
    with pytest.raises(MergeflowError, match="cannot stream"):
        merge_files("exact", paths, out, fishers=fisher_paths)
    save_file(
        {"layer.weight": torch.zeros(7, 4), "layer.bias": torch.zeros(7), "steps": torch.zeros(1)},
        str(tmp_path / "odd.safetensors"),
    )
    with pytest.raises(MergeflowError, match="architectures differ"):
        merge_files("average", [*paths, tmp_path / "odd.safetensors"], out)
    (tmp_path / "broken.safetensors").write_bytes(b"\x80\x04not safetensors")
    with pytest.raises(MergeflowError, match="broken.safetensors"):
        merge_files("average", [*paths, tmp_path / "broken.safetensors"], out)
    assert not out.exists() and not list(tmp_path.glob(".m.safetensors*"))
