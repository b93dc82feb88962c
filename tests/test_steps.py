"""The cached-step machinery: hash memo, parsed-array memo, and cache hits that skip Prefect task runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from mergeflow.data.storage import save_dataset
from mergeflow.errors import MergeflowError
from tasks.execution import run_steps
from tasks.steps import Step
from tasks.store import sha256_file

CALLS: list[str] = []


def record_step(params: dict, root: Path, out: Path, _settings: dict) -> dict:
    """A step that notes each execution and writes one file."""
    CALLS.append(params["name"])
    (out / "outputs").mkdir(parents=True, exist_ok=True)  # an earlier step of the wave may have made it
    (out / "outputs" / f"{params['name']}.txt").write_text(params["name"])
    return {"name": params["name"]}


def settings_step(params: dict, root: Path, out: Path, settings: dict) -> dict:
    """A step that returns what it was given."""
    return {"params": params, "settings": settings}


def test_a_step_gets_its_settings_apart_from_its_keyed_params(tmp_path):
    from tasks.execution import _run_step, _scratch

    step = Step("s", f"{__name__}:settings_step", {"name": "s"}, settings={"stream_above_mb": 1})
    with _scratch(str(tmp_path)) as scratch:
        summary = _run_step(step, str(tmp_path), 1, scratch)["summary"]
    assert summary == {"params": {"name": "s"}, "settings": {"stream_above_mb": 1}}


def test_a_file_rewritten_in_place_is_hashed_again(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(b"a" * 64)
    first = sha256_file(path)
    path.write_bytes(b"b" * 64)  # same size, same inode, within the clock's granularity
    assert sha256_file(path) != first


def test_a_settled_file_is_read_once_and_an_in_place_rewrite_keeping_its_mtime_is_seen(tmp_path, monkeypatch):
    import tasks.store

    path = tmp_path / "data.bin"
    path.write_bytes(b"a" * 64)
    old = 1_000_000_000 * 10**9
    os.utime(path, ns=(old, old))
    monkeypatch.setattr(tasks.store, "_SETTLED_NS", 0)  # the ctime is recent; treat the file as settled
    first = sha256_file(path)
    with monkeypatch.context() as patch:
        patch.setattr(Path, "open", lambda *args, **kwargs: pytest.fail("a settled file was read again"))
        assert sha256_file(path) == first
    path.write_bytes(b"b" * 64)
    os.utime(path, ns=(old, old))  # same path, inode, size and mtime (cp -p, rsync --inplace): the ctime moved
    assert sha256_file(path) != first


def test_read_arrays_parses_a_replaced_file_again_and_hands_out_copies(tmp_path):
    import datasets

    from tasks.prepared import read_arrays

    info = {"task": "classification", "input_shape": [2], "num_classes": 2}
    path = tmp_path / "split.parquet"

    def write(values):
        rows = {"x": [[v, v] for v in values], "y": [0, 1]}
        save_dataset(datasets.Dataset.from_dict(rows), path)

    write([1.0, 2.0])
    X, y = read_arrays(path, info)
    X[:] = 0  # a caller's copy: the memo must not see this
    np.testing.assert_array_equal(read_arrays(path, info)[0], [[1.0, 1.0], [2.0, 2.0]])
    write([3.0, 4.0])  # atomic replace: a new inode
    np.testing.assert_array_equal(read_arrays(path, info)[0], [[3.0, 3.0], [4.0, 4.0]])
    np.testing.assert_array_equal(y, [0, 1])


def test_cache_hits_skip_prefect_task_runs_unless_prefect_refreshes_the_cache(tmp_path, prefect_settings, monkeypatch):
    import prefect
    from prefect import flow
    from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, temporary_settings

    steps = [Step(f"s{i}", f"{__name__}:record_step", {"name": f"s{i}"}) for i in range(3)]

    @flow
    def run() -> list:
        return run_steps(steps, tmp_path)

    CALLS.clear()
    assert not any(outcome.cached for outcome in run())
    assert sorted(CALLS) == ["s0", "s1", "s2"]
    (tmp_path / "outputs" / "s1.txt").unlink()

    def no_task_runs(*args, **kwargs):
        raise AssertionError("a cached step was submitted to Prefect")

    with monkeypatch.context() as patch:
        patch.setattr(prefect.Task, "submit", no_task_runs)
        outcomes = run()
    assert all(outcome.cached for outcome in outcomes) and len(CALLS) == 3
    assert (tmp_path / "outputs" / "s1.txt").read_text() == "s1"  # materialised from the store

    with temporary_settings(updates={PREFECT_TASKS_REFRESH_CACHE: True}):
        outcomes = run()
    assert not any(outcome.cached for outcome in outcomes) and len(CALLS) == 6

    from tasks.store import ArtifactStore

    for digest in outcomes[2].files.values():
        ArtifactStore(tmp_path).blob(digest).unlink()  # the record stays, its blobs are gone
    outcomes = run()
    assert [outcome.cached for outcome in outcomes] == [True, True, False] and CALLS[6:] == ["s2"]
    assert run()[2].cached  # the re-run rewrote the record


def test_the_run_summary_lists_few_steps_and_counts_many():
    from flows.summary import step_summary

    rounds = [f"federated/fedavg/r{r:03d}/client_{k:03d}" for r in range(3) for k in range(4)]
    assert step_summary(["merge/task_arithmetic"]) == "merge/task_arithmetic"
    assert step_summary(["prepare", *rounds, "evaluate"]) == "prepare, federated/… (12 steps), evaluate"


def failing_step(params: dict, root: Path, out: Path, _settings: dict) -> dict:
    """``record_step``, except that it fails for the name in the ``FAIL`` file (a crash mid-batch)."""
    if (root / "FAIL").is_file() and (root / "FAIL").read_text() == params["name"]:
        raise RuntimeError(f"{params['name']} failed")
    return record_step(params, root, out, _settings)


def test_steps_run_several_to_a_task_are_cached_one_by_one(tmp_path, prefect_settings):
    from prefect import flow

    steps = [Step(f"b{i}", f"{__name__}:failing_step", {"name": f"b{i}"}) for i in range(5)]

    @flow
    def run(per_task: int) -> list:
        return run_steps(steps, tmp_path, steps_per_task=per_task)

    CALLS.clear()
    (tmp_path / "FAIL").write_text("b3")
    with pytest.raises(Exception, match="b3 failed"):
        run(2)  # tasks [b0 b1] [b2 b3] [b4]: b3 fails after b2 finished in the same task run
    assert "b2" in CALLS
    (tmp_path / "FAIL").unlink()
    CALLS.clear()
    outcomes = run(2)
    # b0, b1, b2 finished before the crash and stay cached; b4's task may have run as well
    assert [o.cached for o in outcomes[:4]] == [True, True, True, False] and "b3" in CALLS
    assert [o.summary for o in outcomes] == [{"name": f"b{i}"} for i in range(5)]
    assert [(tmp_path / "outputs" / f"b{i}.txt").read_text() for i in range(5)] == [f"b{i}" for i in range(5)]
    # A record written inside a batch is the record a one-step task run would have written.
    assert all(o.cached for o in run(1))


def chained_step(params: dict, root: Path, out: Path, _settings: dict) -> dict:
    """Appends its name to what the step before it wrote (``params["after"]``), failing for the name in ``FAIL``."""
    failing_step(params, root, out, _settings)
    before = (root / "outputs" / f"{params['after']}.txt").read_text() if params["after"] else ""
    (out / "outputs" / f"{params['name']}.txt").write_text(before + params["name"] + params.get("version", ""))
    return {"name": params["name"]}


def chain(first: str) -> list[list[Step]]:
    """Four waves of one ``chained_step`` each, every one reading what the one before it wrote."""
    names = [f"{first}{i}" for i in range(4)]
    return [
        [Step(name, f"{__name__}:chained_step", {"name": name, "after": after}, inputs=(f"outputs/{after}.txt",))]
        for name, after in zip(names, ["", *names[:-1]], strict=True)
    ]


def test_waves_run_together_key_each_wave_on_the_one_before_and_resume_step_by_step(tmp_path, prefect_settings):
    from prefect import flow

    from tasks.execution import run_waves

    @flow
    def run(waves: list[list[Step]], together: bool) -> list:
        if together:
            return run_waves(waves, tmp_path)
        return [outcome for wave in waves for outcome in run_steps(wave, tmp_path)]

    CALLS.clear()
    (tmp_path / "FAIL").write_text("a2")
    with pytest.raises(Exception, match="a2 failed"):
        run(chain("a"), True)
    (tmp_path / "FAIL").unlink()
    outcomes = run(chain("a"), True)
    assert [o.cached for o in outcomes] == [True, True, False, False]  # a0, a1 finished before the crash
    assert (tmp_path / "outputs" / "a3.txt").read_text() == "a0a1a2a3"  # a3 read what a2 wrote in the same task run
    # wave by wave, one task run each: the same keys and records, so every step is a hit
    assert all(o.cached for o in run(chain("a"), False))
    # a first step that writes something else changes every key after it: each wave is keyed on the one before
    CALLS.clear()
    changed = Step("a0", f"{__name__}:chained_step", {"name": "a0", "after": "", "version": "'"})
    again = run([[changed], *chain("a")[1:]], True)
    assert not any(o.cached for o in again) and CALLS == ["a0", "a1", "a2", "a3"]
    assert (tmp_path / "outputs" / "a3.txt").read_text() == "a0'a1a2a3"


def test_atomic_writes_skip_the_temp_file_only_inside_a_private_directory(tmp_path, monkeypatch):
    from mergeflow.files import private_directory, write_json

    renamed = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: renamed.append((Path(src), Path(dst))) or real(src, dst))
    with private_directory(tmp_path / "scratch"):
        write_json(tmp_path / "scratch" / "deep" / "a.json", {"a": 1})  # a step's scratch output: in place
        write_json(tmp_path / "outside.json", {"b": 2})  # anything else: temp file and rename
    write_json(tmp_path / "scratch" / "after.json", {"c": 3})
    assert [dst for _, dst in renamed] == [tmp_path / "outside.json", tmp_path / "scratch" / "after.json"]
    assert all(src.parent == dst.parent and src.name.endswith(".tmp") for src, dst in renamed)
    assert (tmp_path / "scratch" / "deep" / "a.json").read_text().strip().endswith("}")
    assert sorted(p.name for p in tmp_path.rglob("*.tmp")) == []


def test_outputs_are_read_only_links_to_the_store_that_writers_replace_not_change(tmp_path, monkeypatch):
    import errno
    import stat

    from mergeflow.files import write_json
    from tasks.store import ArtifactStore

    store = ArtifactStore(tmp_path)
    (tmp_path / "work" / "out").mkdir(parents=True)
    (tmp_path / "work" / "out" / "a.json").write_text("{}\n")
    manifest = store.ingest(tmp_path / "work")
    store.materialise(manifest)
    target, blob = tmp_path / "out" / "a.json", store.blob(manifest["out/a.json"])
    assert os.path.samefile(target, blob) and stat.S_IMODE(blob.stat().st_mode) == 0o444
    write_json(target, {"edited": 1})  # every writer here replaces a file by a rename
    assert blob.read_text() == "{}\n" and not os.path.samefile(target, blob)
    store.materialise(manifest)
    assert os.path.samefile(target, blob)

    def no_link(*args, **kwargs):
        raise OSError(errno.EXDEV, "cross-device link")

    target.unlink()
    monkeypatch.setattr(os, "link", no_link)  # e.g. the store on another file system: a copy
    store.materialise(manifest)
    assert target.read_text() == "{}\n" and not os.path.samefile(target, blob)


def test_steps_keyed_together_hash_their_code_once_and_get_the_same_keys(tmp_path, monkeypatch):
    import tasks.steps
    from tasks.steps import project_root_of_code, step_key

    roots = []
    real = tasks.steps.hash_paths
    monkeypatch.setattr(tasks.steps, "hash_paths", lambda root, paths: roots.append(Path(root)) or real(root, paths))
    steps = [Step(f"s{i}", "tasks.store:hash_paths", {"name": f"s{i}"}) for i in range(3)]
    code_hashes: dict = {}
    keys = [step_key(step, tmp_path, code_hashes) for step in steps]
    assert roots.count(project_root_of_code()) == 1 and len(set(keys)) == 3
    assert keys == [step_key(step, tmp_path) for step in steps]


def test_a_steps_key_follows_the_code_its_module_imports_and_the_memo_is_per_step_code(tmp_path, monkeypatch):
    import tasks.steps
    from tasks.steps import step_key

    code_root = tmp_path / "code"
    (code_root / "pkg").mkdir(parents=True)
    (code_root / "pkg/__init__.py").write_text("")
    (code_root / "a.py").write_text("def fn():\n    from pkg import helper  # a lazy import counts too\n")
    (code_root / "pkg/helper.py").write_text("x = 1\n")
    (code_root / "b.py").write_text("import json\n")
    monkeypatch.setattr(tasks.steps, "project_root_of_code", lambda: code_root)
    on_a, on_b = Step("s", "a:fn", {"name": "s"}), Step("s", "b:fn", {"name": "s"})  # same name and params
    assert on_a.code == ("a.py", "pkg/__init__.py", "pkg/helper.py") and on_b.code == ("b.py",)
    memo: dict = {}
    before_a, before_b = step_key(on_a, tmp_path, memo), step_key(on_b, tmp_path, memo)
    assert before_b != before_a  # the memo did not hand b's step a's hash
    (code_root / "pkg/helper.py").write_text("x = 2\n")  # imported by a, lazily: a's key only
    assert step_key(on_a, tmp_path) != before_a and step_key(on_b, tmp_path) == before_b
    assert step_key(on_a, tmp_path, memo) == before_a  # within one memo: the code the process imported


def test_ingest_leaves_its_folder_without_files_when_the_content_is_stored_already(tmp_path):
    from tasks.store import ArtifactStore

    store, work = ArtifactStore(tmp_path), tmp_path / "work"
    work.mkdir()
    (work / "a.txt").write_text("same")
    assert list(store.ingest(work)) == ["a.txt"]
    (work / "b.txt").write_text("same")  # the next step in the same scratch folder: the same bytes
    assert list(store.ingest(work)) == ["b.txt"]
    (work / "c.txt").write_text("other")
    assert list(store.ingest(work)) == ["c.txt"]  # b.txt did not stay behind to join c's outputs


def test_a_chain_stops_once_its_steps_turn_out_long_and_leaves_the_rest_of_its_waves(tmp_path, prefect_settings):
    from prefect import flow

    from tasks.execution import run_waves
    from tasks.runner import _after

    @flow
    def run(ran_before: list[float], short_below: float) -> list:
        return run_waves(chain("c"), tmp_path, ran_before=ran_before, short_below=short_below)

    CALLS.clear()
    assert [o.name for o in run([], 0.0)] == ["c0"] and CALLS == ["c0"]  # every step counts as long: one, then stop
    # two long steps before the chain: the first that runs (c1; c0 is a hit) keeps the typical time long
    assert [(o.name, o.cached) for o in run([9.0, 9.0], 0.5)] == [("c0", True), ("c1", False)]
    assert [o.cached for o in run([], 0.5)] == [True, True, False, False] and CALLS == ["c0", "c1", "c2", "c3"]
    assert _after([["a"], ["b", "c"], ["d"]], 2) == [["c"], ["d"]] and _after([["a"], ["b"]], 2) == []


def test_a_chain_removes_each_waves_emptied_folders_from_its_scratch_folder(tmp_path):
    from tasks.execution import _remove_empty

    (tmp_path / "m/algo/round_001").mkdir(parents=True)
    (tmp_path / "m/algo/round_002").mkdir(parents=True)
    (tmp_path / "m/algo/round_002/left.tmp").write_text("")
    _remove_empty(tmp_path, {Path("m/algo/round_001"), Path("m/algo/round_002"), Path(".")})
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "m",
        "m/algo",
        "m/algo/round_002",
        "m/algo/round_002/left.tmp",
    ]


def test_an_output_written_into_in_place_is_caught_and_its_blob_made_again(tmp_path):
    from tasks.store import ArtifactStore

    store, work = ArtifactStore(tmp_path), tmp_path / "work"
    (work / "out").mkdir(parents=True)
    (work / "out" / "a.txt").write_text("made")
    files = store.ingest(work)
    store.materialise(files)
    target, blob = tmp_path / "out" / "a.txt", store.blob(files["out/a.txt"])
    past = blob.stat().st_mtime_ns - 10**10  # clear of the clock's granularity
    os.utime(blob, ns=(past, past))
    stamps = store.stamps(files)
    assert store.has(files, stamps)
    os.utime(blob, ns=(past + 10**9, past + 10**9))  # a store copied without its times: the same bytes
    assert store.has(files, stamps) and blob.exists()
    target.chmod(0o644)  # (root needs no chmod)
    target.write_text("changed")  # through the hard link: the stored copy changes too
    assert not store.has(files, stamps) and not blob.exists()  # a miss: its step runs again
    (work / "out" / "a.txt").write_text("made")
    again = store.ingest(work)
    store.materialise(again)
    assert again == files and target.read_text() == "made" and store.has(again, store.stamps(again))


def test_records_are_mergeflows_own_json_and_a_foreign_record_is_a_miss(tmp_path):
    from tasks.records import RECORD_FORMAT, read_record, record_name, results_dir, write_record

    step = Step("fisher/client_000", "tasks.fisher:client_fisher", {"client": 0})
    outcome = {"files": {"models/x.safetensors": "ab" * 32}, "stamps": {}, "summary": {"n": 1}, "seconds": 0.5}
    write_record(tmp_path, step, "k1", outcome)
    path = results_dir(tmp_path) / record_name(step, "k1")
    saved = json.loads(path.read_text())
    assert saved["format"] == RECORD_FORMAT and "metadata" not in saved  # no Prefect result record
    assert read_record(tmp_path, step, "k1") == saved and saved["files"] == outcome["files"]
    assert read_record(tmp_path, step, "k2") is None  # another key: a miss
    path.write_text(json.dumps({"metadata": {}, "result": json.dumps(outcome)}))  # Prefect's old format
    assert read_record(tmp_path, step, "k1") is None


def test_a_step_is_not_keyed_by_code_that_changed_after_the_run_started(tmp_path, monkeypatch):
    """A process runs the modules it imported at its start; a key that hashed a file edited since would
    file a result under code that did not make it. Keying stops instead, naming the file."""
    import tasks.steps
    from tasks.steps import step_key

    step = Step("s", "tasks.store:hash_paths", {"name": "s"})
    step_key(step, tmp_path)  # every code file older than the process: keyed as usual
    monkeypatch.setattr(tasks.steps, "_STARTED_NS", 0)  # as if each of them had changed since
    with pytest.raises(MergeflowError, match=r"^\S+\.py changed after this process started .* Start the run again"):
        step_key(step, tmp_path)


def test_a_process_whose_code_predates_the_files_runs_no_step(tmp_path, monkeypatch):
    """A Dask worker that outlives a run keeps the modules it imported; the next run keys its steps by
    the files as they are now. The worker refuses to run them, naming the file, before any work."""
    import tasks.execution
    import tasks.steps
    from tasks.execution import _run_step

    ran = []
    monkeypatch.setattr(tasks.execution, "resolve", lambda fn: lambda *args: ran.append(fn) or {})
    step = Step("s", "tasks.store:hash_paths", {"name": "s"})
    (tmp_path / "scratch").mkdir()
    _run_step(step, str(tmp_path), 1, tmp_path / "scratch")  # code older than the process: it runs
    assert ran == ["tasks.store:hash_paths"]
    monkeypatch.setattr(tasks.steps, "_STARTED_NS", 0)  # as if every file had changed since the worker started
    stale = r"^\S+\.py changed after this process started .* restart its workers first\.$"
    with pytest.raises(MergeflowError, match=stale):
        _run_step(step, str(tmp_path), 1, tmp_path / "scratch")
    assert len(ran) == 1
