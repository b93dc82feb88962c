"""Streaming merges from safetensors files and Hugging Face directories equal the in-memory merges.

Tolerance: none. Streaming runs each method's float64 arithmetic on the same elements as the
in-memory merge (elementwise methods in blocks, the others on whole tensors) and rounds once to
the output dtype, so the tests compare bit for bit.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mergeflow import safetensors_io
from mergeflow.errors import MergeflowError
from mergeflow.merge import METHODS, merge, sparsify, streaming
from mergeflow.merge.streaming import merge_files

TENSOR_METHODS = sorted(name for name, declaration in METHODS.items() if declaration.scope == "tensor")


def _write(tmp_path, count: int = 3, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)

    def state():
        return {
            "layer.weight": torch.randn(7, 5, generator=generator).to(dtype),
            "layer.bias": torch.randn(7, generator=generator).to(dtype),
            "layer.empty": torch.randn(0, 4, generator=generator).to(dtype),  # a tensor with no elements
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


def _gpt2(seed: int, dtype: torch.dtype):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(
        GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
    ).to(dtype)


def _tokenizer(directory):
    from transformers import GPT2Tokenizer

    vocab = {token: i for i, token in enumerate(["<|endoftext|>", "a", "b", "c", "ab"])}
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\na b\n")
    return GPT2Tokenizer(vocab_file=str(directory / "vocab.json"), merges_file=str(directory / "merges.txt"))


def _save_sharded(state: dict[str, torch.Tensor], directory) -> None:
    directory.mkdir()
    save_torch_state_dict(state, directory, max_shard_size="20KB")


def _load_dir(directory) -> dict[str, torch.Tensor]:
    shards = set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"].values())
    return {key: value for shard in sorted(shards) for key, value in load_file(str(directory / shard)).items()}


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def gpt2_dirs(request, tmp_path_factory):
    """Three fine-tuned GPT-2s, a base and three Fishers (no Fisher for ``wpe``), as sharded HF directories."""
    dtype = request.param
    root = tmp_path_factory.mktemp(f"gpt2-{str(dtype).removeprefix('torch.')}")
    models = []
    for seed in range(4):
        model = _gpt2(seed, dtype)
        model.save_pretrained(root / f"model_{seed}", max_shard_size="20KB")
        models.append(root / f"model_{seed}")
    _tokenizer(root).save_pretrained(root / "model_0")
    generator = torch.Generator().manual_seed(9)
    fishers = []
    for k in range(3):
        fisher = {
            key: torch.rand(value.shape, generator=generator).to(dtype)
            for key, value in _load_dir(models[k]).items()
            if key != "transformer.wpe.weight"
        }
        _save_sharded(fisher, root / f"fisher_{k}")
        fishers.append(root / f"fisher_{k}")
    return dtype, models[:3], models[3], fishers


@pytest.mark.parametrize("method", TENSOR_METHODS)
def test_streaming_equals_the_in_memory_merge_on_sharded_checkpoints(gpt2_dirs, tmp_path, monkeypatch, method):
    dtype, models, base, fishers = gpt2_dirs
    monkeypatch.setattr(streaming, "BLOCK", 1024)  # several blocks per tensor, and a partial last one
    monkeypatch.setattr(streaming, "_MASK_READ_BLOCK", 1000)  # task vectors read for masks in several blocks too
    monkeypatch.setattr(streaming, "_OPERAND_BLOCK", 1000)  # and the compiled masks' operands (fp32)
    monkeypatch.setattr(streaming, "STORED_BLOCK", 1500)  # blocks merged from the files as stored (fp32)
    monkeypatch.setattr(sparsify, "_MERGE_PER_THREAD", 300)  # each split between the threads
    monkeypatch.setattr(safetensors_io, "_WRITE_CHUNK", 1000)  # each tensor written in several calls
    declaration = METHODS[method]
    count = 2 if method == "slerp" else 3
    files, memory = {}, {}
    if "base" in declaration.needs:
        files["base"], memory["base"] = base, _load_dir(base)
    if "fishers" in declaration.needs:
        files["fishers"], memory["fishers"] = fishers[:count], [_load_dir(f) for f in fishers[:count]]
    if "sizes" in declaration.needs or "fishers" in declaration.needs:
        files["weights"] = memory["weights"] = [1.0, 2.0, 4.0][:count]
    assert all(need in ("base", "fishers", "sizes") for need in declaration.needs), f"give the test {method}'s inputs"
    # Both on the same two threads: LAPACK's SVD splits its work by the thread count, so a spectral merge such as
    # tsv differs in the last bit on another count (1 of 32768 elements after an earlier test left torch on 1).
    with streaming._intra_op_threads(2):
        merge_files(method, models[:count], tmp_path / "merged", max_shard_size="20KB", **files)
        expected = merge(method, [_load_dir(m) for m in models[:count]], **memory)
    streamed = _load_dir(tmp_path / "merged")
    assert streamed.keys() == expected.keys()
    for key in expected:
        assert streamed[key].dtype == dtype == expected[key].dtype
        torch.testing.assert_close(streamed[key], expected[key], rtol=0, atol=0)


def test_merged_directory_reloads_with_transformers_and_keeps_tied_weights(gpt2_dirs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype, models, _, _ = gpt2_dirs
    out = tmp_path / "merged"
    merge_files("average", models, out, max_shard_size="20KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" not in index["weight_map"]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (models[0] / name).read_bytes()
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(models[0]).get_vocab()

    inputs = [AutoModelForCausalLM.from_pretrained(m, dtype=dtype).state_dict() for m in models]
    expected = merge("average", inputs)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    assert merged.lm_head.weight.data_ptr() == merged.transformer.wte.weight.data_ptr()
    reloaded = merged.state_dict()
    assert reloaded.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(reloaded[key], expected[key], rtol=0, atol=0)


def test_half_precision_stays_half_unless_out_dtype_asks(gpt2_dirs, tmp_path):
    dtype, models, _, _ = gpt2_dirs
    merge_files("average", models, tmp_path / "kept")
    assert (tmp_path / "kept" / "model.safetensors").is_file()  # below the default 5GB: one file, no index
    kept = load_file(str(tmp_path / "kept" / "model.safetensors"))
    assert {t.dtype for t in kept.values()} == {dtype}
    merge_files("average", models, tmp_path / "wide", out_dtype="float64")
    wide = load_file(str(tmp_path / "wide" / "model.safetensors"))
    assert {t.dtype for t in wide.values()} == {torch.float64}
    assert json.loads((tmp_path / "wide" / "config.json").read_text())["dtype"] == "float64"
    torch.testing.assert_close(wide["transformer.wte.weight"].to(dtype), kept["transformer.wte.weight"])
    inputs = [_load_dir(model) for model in models]
    for key, value in wide.items():  # the float64 mean itself, never rounded through the inputs' dtype
        exact = merge("average", [{key: state[key].double()} for state in inputs])[key]
        torch.testing.assert_close(value, exact, rtol=0, atol=0)
    if dtype != torch.float32:  # bf16 inputs: the float64 mean has bits that bf16 cannot hold
        assert any(not torch.equal(wide[key], kept[key].double()) for key in wide)


@pytest.mark.parametrize(
    ("method", "extra"),
    [
        ("average", {}),
        ("weighted", {"weights": [1, 2, 3]}),
        ("task_arithmetic", {"scaling": 0.4}),
        ("fisher", {"weights": [1, 2, 3]}),
        ("ties", {"density": 0.3}),
        ("dare_linear", {"drop_rate": 0.5, "seed": 3}),
        ("model_stock", {}),
    ],
)
def test_single_files_with_integer_tensors_stream_like_the_in_memory_merge(tmp_path, method, extra):
    states, fishers, base, paths, fisher_paths = _write(tmp_path)
    files, memory = {}, {}
    if "base" in METHODS[method].needs:
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


def test_accumulation_is_float64_rounded_once(tmp_path):
    """float32 inputs whose float32 running sum loses digits: the streamed mean is the float64 mean rounded once."""
    big, small = torch.full((300_000,), 2.0**24), torch.full((300_000,), 1.0)
    paths = []
    for k, tensor in enumerate([big, small, small, -big]):
        paths.append(tmp_path / f"m{k}.safetensors")
        save_file({"w": tensor}, str(paths[-1]))
    merge_files("average", paths, tmp_path / "out.safetensors")
    assert torch.equal(load_file(str(tmp_path / "out.safetensors"))["w"], torch.full((300_000,), 0.5))


def test_refusals_name_the_file_and_leave_no_output(tmp_path):
    _, _, _, paths, fisher_paths = _write(tmp_path)
    out = tmp_path / "m.safetensors"
    with pytest.raises(MergeflowError, match="cannot stream"):
        merge_files("exact", paths, out, fishers=fisher_paths)
    with pytest.raises(MergeflowError, match="needs sizes"):
        merge_files("weighted", paths, out)
    with pytest.raises(MergeflowError, match="out_dtype 'int8'"):
        merge_files("average", paths, out, out_dtype="int8")
    save_file(
        {
            "layer.weight": torch.zeros(7, 4),
            "layer.bias": torch.zeros(7),
            "layer.empty": torch.zeros(0, 4),
            "steps": torch.zeros(1),
        },
        str(tmp_path / "odd.safetensors"),
    )
    with pytest.raises(MergeflowError, match="odd.safetensors.*architectures differ"):
        merge_files("average", [*paths, tmp_path / "odd.safetensors"], out)
    (tmp_path / "broken.safetensors").write_bytes(b"\x80\x04not safetensors")
    with pytest.raises(MergeflowError, match="broken.safetensors"):
        merge_files("average", [*paths, tmp_path / "broken.safetensors"], out)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(paths[0].read_bytes()[:-8])
    with pytest.raises(MergeflowError, match="truncated.safetensors: truncated"):
        merge_files("average", [*paths, truncated], out)
    assert not out.exists() and not list(tmp_path.glob(".m.safetensors*"))


def test_bad_directories_raise_one_clear_error_naming_the_file(gpt2_dirs, tmp_path):
    _, models, _, _ = gpt2_dirs
    out = tmp_path / "merged"

    def refused(inputs, pattern):
        with pytest.raises(MergeflowError, match=pattern):
            merge_files("average", inputs, out)

    refused([models[0], tmp_path / "missing"], "missing: checkpoint not found")
    (tmp_path / "empty").mkdir()
    refused([models[0], tmp_path / "empty"], "empty: no model.safetensors or model.safetensors.index.json")
    lost = tmp_path / "lost"
    lost.mkdir()
    index = json.loads((models[1] / "model.safetensors.index.json").read_text())
    (lost / "model.safetensors.index.json").write_text(json.dumps(index))
    first_shard = next(iter(index["weight_map"].values()))
    refused([models[0], lost], f"lost/model.safetensors.index.json: names shard {first_shard}, which is missing")
    fewer = tmp_path / "fewer"
    state = _load_dir(models[1])
    state.pop("transformer.h.1.mlp.c_proj.bias")
    _save_sharded(state, fewer)
    refused([models[0], fewer], "fewer: different tensors from .*: transformer.h.1.mlp.c_proj.bias")
    wider = tmp_path / "wider"
    model = _gpt2(0, torch.float32)
    model.resize_token_embeddings(101)
    model.save_pretrained(wider, max_shard_size="20KB")
    refused([models[0], wider], "wider: tensor 'transformer.wte.weight' has shape .*architectures differ")
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_failed_merge_leaves_the_previous_output_whole(gpt2_dirs, tmp_path, monkeypatch):
    _, models, _, _ = gpt2_dirs
    out = tmp_path / "merged"
    merge_files("average", models[:2], out, max_shard_size="20KB")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    writes = []

    def failing_write(self, key, data):
        writes.append(key)
        if len(writes) > 5:
            raise OSError("disk full")

    monkeypatch.setattr(streaming.ShardedWriter, "write", failing_write)
    threads = torch.get_num_threads()
    with pytest.raises(OSError, match="disk full") as failure:  # its traceback keeps merge_files' frame alive
        merge_files("average", models, out, max_shard_size="20KB")
    assert failure.traceback and torch.get_num_threads() == threads
    assert "mergeflow-reader" not in [thread.name for thread in threading.enumerate()]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]
    monkeypatch.undo()
    merge_files("average", models, out, max_shard_size="20KB")  # replaces the older output
    torch.testing.assert_close(_load_dir(out), merge("average", [_load_dir(m) for m in models]), rtol=0, atol=0)


def test_the_reader_keeps_its_torch_thread_count_when_another_thread_changes_it():
    """The reader converts blocks on the thread count it was started with, even when the merging thread then
    draws masks on every core: a thread's first parallel op would otherwise take the count set last."""
    before, ready, go, seen = torch.get_num_threads(), threading.Event(), threading.Event(), []

    def reader_start():
        streaming._torch_threads(1)
        ready.set()
        go.wait()
        seen.append(torch.get_num_threads())

    with streaming.Reader([], lambda item, buffers: None, [], start=reader_start):
        ready.wait()
        torch.set_num_threads(3)
        go.set()
    torch.set_num_threads(before)
    assert seen == [1]


def test_a_blocked_merge_reads_on_one_torch_thread(gpt2_dirs, tmp_path, monkeypatch):
    _, models, base, _ = gpt2_dirs
    counts = []
    pin = streaming._torch_threads
    monkeypatch.setattr(streaming, "_torch_threads", lambda count: counts.append(count) or pin(count))
    with streaming._intra_op_threads(2):
        merge_files("ties", models, tmp_path / "merged.safetensors", base=base, density=0.5)
    assert counts == [1]


def test_mask_merges_on_the_cpu_merge_float32_files_as_stored_without_reading_them(gpt2_dirs, tmp_path, monkeypatch):
    """TIES on float32 files merges views of the memory maps (declared ``stored``): the reader reads
    nothing; bf16 files are read and widened as before. Both equal the in-memory merge (the test above)."""
    dtype, models, base, _ = gpt2_dirs
    reads = []
    read = streaming._Staging.read
    monkeypatch.setattr(
        streaming._Staging,
        "read",
        lambda self, checkpoint, key, *a: reads.append(key) or read(self, checkpoint, key, *a),
    )
    merge_files("ties", models, tmp_path / "merged.safetensors", base=base, density=0.5)
    assert (reads == []) == (dtype == torch.float32)
