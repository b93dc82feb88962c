"""The device stays out of the step cache key; each record says which device made it, and a run whose
results come from more than one device says so (docs/operations.md, "Devices and the cache")."""

from __future__ import annotations

from pathlib import Path

import tasks.records
from mergeflow.config import validate_params
from tasks.execution import _run_step, _scratch
from tasks.records import cached_outcomes, write_record
from tasks.runner import warn_mixed_devices
from tasks.step_devices import device_settings, mixed_devices_warning
from tasks.steps import Step, StepOutcome, step_key


def write_step(params: dict, root: Path, out: Path, _settings: dict) -> dict:
    """A step that writes one file."""
    (out / f"{params['name']}.txt").write_text(params["name"])
    return {}


def _step(name: str, device: str | None) -> Step:
    settings = device_settings(validate_params({"orchestration": {"device": device}})) if device else {}
    return Step(name, f"{__name__}:write_step", {"name": name, "train": {}}, settings=settings)


def test_switching_devices_keeps_every_key_and_each_record_names_its_device(tmp_path):
    on_cpu, on_gpu = _step("train", "cpu"), _step("train", "cuda:0")
    assert on_gpu.settings["device"] == "cuda:0"
    assert step_key(on_cpu, tmp_path) == step_key(on_gpu, tmp_path) == step_key(_step("train", None), tmp_path)
    with _scratch(str(tmp_path)) as scratch:
        made = _run_step(on_cpu, str(tmp_path), 1, scratch)
        plain = _run_step(_step("prepare", None), str(tmp_path), 1, scratch)
    assert (made["device"], made["device_name"], made["precision"]) == ("cpu", "cpu", "fp32")
    assert "device" not in plain  # a step that computes on no device notes none


def test_a_run_reusing_results_made_on_another_device_warns_once(tmp_path, capsys, monkeypatch):
    gpu_made, old, data = _step("finetune", "cuda"), _step("fisher", "cpu"), _step("prepare", None)
    write_record(
        tmp_path, gpu_made, "k1", {"files": {}, "summary": {}, "device": "cuda:0", "device_name": "NVIDIA H100"}
    )
    write_record(tmp_path, old, "k2", {"files": {}, "summary": {}})  # recorded before devices were noted
    write_record(tmp_path, data, "k3", {"files": {}, "summary": {}})
    keyed = {gpu_made.name: "k1", old.name: "k2", data.name: "k3"}
    monkeypatch.setattr(tasks.records, "step_key", lambda step, root, hashes=None: keyed[step.name])
    outcomes = cached_outcomes([gpu_made, old, data], tmp_path)
    assert [outcome.device for outcome in outcomes] == ["NVIDIA H100", "cpu", None]
    warn_mixed_devices(outcomes)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "NVIDIA H100: 1 steps (e.g. finetune)" in err and "cpu: 1 steps" in err
    assert mixed_devices_warning([("a", "cpu"), ("b", "cpu"), ("c", None)]) is None
    same = [StepOutcome("a", True, 0.0, device="cpu"), StepOutcome("b", False, 1.0, device="cpu")]
    warn_mixed_devices(same)
    assert capsys.readouterr().err == ""


def test_gpu_steps_share_the_gpu_within_gpu_workers_and_ask_dask_for_a_gpu(monkeypatch):
    import threading
    import time

    import dask
    import torch

    import mergeflow.device
    from tasks.step_devices import dask_annotation, dask_resources, gpu_slot

    monkeypatch.setattr(mergeflow.device, "resolve_device", lambda setting: torch.device("cuda", 0))
    settings = device_settings(validate_params({"orchestration": {"device": "cuda", "gpu_workers": 2}}))
    running, most = [0], [0]
    lock = threading.Lock()

    def step() -> None:
        with gpu_slot(settings):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.2)
            with lock:
                running[0] -= 1

    threads = [threading.Thread(target=step) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 2
    cuda, auto, cpu, data = _step("a", "cuda:1"), _step("b", "auto"), _step("c", "cpu"), _step("d", None)
    assert dask_resources([cuda, data]) == {"GPU": 1}
    assert dask_resources([auto]) == dask_resources([cpu, data]) == {}  # auto: any worker, its GPU if it has one
    with dask_annotation([cuda]):
        assert dask.get_annotations() == {"resources": {"GPU": 1}}
    with dask_annotation([cpu]):
        assert dask.get_annotations() == {}


def test_precision_keys_the_training_steps_only_when_it_is_not_fp32():
    from tasks.training import plan_centralized, plan_finetune

    def trained(precision: str) -> list[dict]:
        params = validate_params({"finetune": {"precision": precision}})
        return [step.params["train"] for step in [*plan_finetune(params), *plan_centralized(params)]]

    assert all("precision" not in train for train in trained("fp32"))  # keys made before precision stay valid
    assert all(train["precision"] == "bf16" for train in trained("bf16"))
