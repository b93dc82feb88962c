"""The compute device of the pipeline's steps: passed to them outside their cache key, noted in their records.

A step that computes (training, Fisher, alignment, merges, federated rounds, evaluation) carries
``orchestration.device`` in its :attr:`~tasks.steps.Step.settings`: they reach the step beside its params
and stay out of its key, since a result does not depend on the device beyond floating-point
rounding. The step resolves it (:func:`step_device`), computes there and writes its files from the
CPU; its record notes the device it ran on (:func:`device_record`), and a run whose outcomes were
made on more than one device says so once (:func:`mixed_devices_warning`). Resolving a setting into a
torch device is the library's (:mod:`mergeflow.device`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from mergeflow.config import Params

if TYPE_CHECKING:
    import torch

DEVICE = "device"  # the settings key, and the record's


def device_settings(params: Params) -> dict[str, Any]:
    """The :attr:`~tasks.steps.Step.settings` of a step that computes on ``orchestration.device``, with
    ``orchestration.gpu_workers`` (how many such steps may use the GPU at once in one process)."""
    return {DEVICE: params.orchestration.device, "gpu_workers": params.orchestration.gpu_workers}


def uses_device(settings: Mapping[str, Any]) -> bool:
    """Whether a step with these settings computes on the device (and so may use a GPU)."""
    return DEVICE in settings


def step_device(settings: Mapping[str, Any]) -> torch.device:
    """The torch device a step's settings name, with deterministic kernels asked for on a GPU; the CPU for a
    step planned without one."""
    from mergeflow.device import resolve_device, use_deterministic

    device = resolve_device(settings.get(DEVICE, "cpu"))
    use_deterministic(device)
    return device


_SLOTS: dict[int, threading.BoundedSemaphore] = {}
_SLOTS_LOCK = threading.Lock()


@contextmanager
def gpu_slot(settings: Mapping[str, Any]) -> Iterator[None]:
    """Hold one of the process's ``gpu_workers`` GPU slots while a step that computes on a GPU runs (threads
    share one GPU: this bounds their memory and contention); nothing for a CPU step."""
    if not uses_device(settings) or settings[DEVICE] == "cpu":
        with nullcontext():
            yield
        return
    from mergeflow.device import resolve_device

    if resolve_device(settings[DEVICE]).type == "cpu":
        yield
        return
    workers = int(settings.get("gpu_workers", 1))
    with _SLOTS_LOCK:
        slot = _SLOTS.setdefault(workers, threading.BoundedSemaphore(workers))
    with slot:
        yield


def dask_resources(steps: Iterable[Any]) -> dict[str, int]:
    """The Dask worker resources a task running ``steps`` asks for: a ``GPU`` when one of them computes on a
    device that names CUDA (``cuda``, ``cuda:N``), so it lands on a worker started with
    ``--resources GPU=1``; none otherwise. ``auto`` asks for none: it runs on any worker, on its GPU if it has
    one (a cluster without GPU workers would otherwise wait forever)."""
    wants = any(str(step.settings.get(DEVICE, "")).startswith("cuda") for step in steps)
    return {"GPU": 1} if wants else {}


@contextmanager
def dask_annotation(steps: Iterable[Any]) -> Iterator[None]:
    """Submit under ``dask.annotate(resources=...)`` when the steps ask for resources (ignored by threads)."""
    resources = dask_resources(steps)
    if not resources:
        yield
        return
    import dask

    with dask.annotate(resources=resources):
        yield


def on_device(tensors: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A copy of a state dict (or any name → tensor mapping) on ``device``."""
    return {name: tensor.to(device) for name, tensor in tensors.items()}


def on_cpu(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors as written to files: on the CPU, contiguous."""
    return {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}


def device_record(settings: Mapping[str, Any], precision: str | None = None) -> dict[str, str]:
    """What a step's record notes of where it ran: ``device`` (``cuda:0``), ``device_name`` and, for a
    training step, ``precision``; nothing for a step that does not compute on the device."""
    if not uses_device(settings):
        return {}
    from mergeflow.device import device_facts

    return device_facts(settings[DEVICE]) | ({"precision": precision} if precision else {})


def made_on(record: Mapping[str, Any]) -> str | None:
    """The device that made a record's outputs (its name), ``cpu`` for a device step recorded before devices
    were noted (everything ran on the CPU then), None for a step that does not compute on a device."""
    if DEVICE in record:
        return str(record.get("device_name") or record[DEVICE])
    return None


def mixed_devices_warning(made: Iterable[tuple[str, str | None]]) -> str | None:
    """The warning for a run whose steps (``(name, made_on)`` pairs) were made on more than one device, or
    None. Results agree up to rounding across devices, so they are reused, but not silently."""
    by_device: dict[str, list[str]] = {}
    for name, device in made:
        if device is not None:
            by_device.setdefault(device, []).append(name)
    if len(by_device) < 2:
        return None
    parts = [f"{device}: {len(names)} steps (e.g. {names[0]})" for device, names in sorted(by_device.items())]
    return (
        "mergeflow: warning: this run's results were made on more than one device ("
        + "; ".join(parts)
        + "); they agree up to floating-point rounding, not bit for bit. To remake them all on this "
        "run's device, run with PREFECT_TASKS_REFRESH_CACHE=true."
    )
