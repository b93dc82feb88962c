"""Where the compute runs (``orchestration.device``) and in what precision (``finetune.precision``).

The setting is ``auto`` (CUDA when torch sees a GPU, else the CPU), ``cpu``, ``cuda``, ``cuda:N`` or
``mps``. Library functions compute on the device of the model or tensors they are given, and make
every tensor they need there; the pipeline's steps (``tasks/``) move the model and data to the
device and write their checkpoints from the CPU. Imports of torch stay inside the functions, so
params validate without it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
PRECISIONS = ("fp32", "bf16", "fp16")


def device_setting_problem(setting: str) -> str | None:
    """Why ``setting`` is not a device setting (torch-free, for the params schema), or None."""
    if DEVICE_PATTERN.match(setting):
        return None
    return f"{setting!r} is not a device; expected auto, cpu, cuda, cuda:N or mps"


def resolve_device(setting: str = "auto") -> torch.device:
    """The torch device of a setting: ``auto`` is the current CUDA device when torch sees one, else the CPU
    (never MPS: it has no float64, which the merges and Fishers accumulate in)."""
    import torch

    if setting == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(setting)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_problem(setting: str, precision: str = "fp32") -> str | None:
    """Why this machine cannot run ``setting`` in ``precision``, naming the key, or None.

    Imports torch only when the setting names an accelerator or a reduced precision asks what the
    device supports; ``cpu`` and ``auto`` in fp32 always run.
    """
    if setting in ("cpu", "auto") and precision == "fp32":
        return None
    import torch

    if setting.startswith("cuda"):
        if not torch.cuda.is_available():
            return f"orchestration.device: {setting!r} needs CUDA, and torch sees no CUDA device here; use auto or cpu"
        count = torch.cuda.device_count()
        index = torch.device(setting).index
        if index is not None and index >= count:
            last = f"cuda:{count - 1}"
            return f"orchestration.device: {setting!r}: this machine has {count} CUDA device(s), cuda:0 to {last}"
    if setting == "mps" and not torch.backends.mps.is_available():
        return "orchestration.device: 'mps' needs Apple's Metal (MPS), and torch sees none here; use auto or cpu"
    device = resolve_device(setting)
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        return f"finetune.precision: bf16 is not supported by {name}; use fp16 or fp32"
    return None


def device_name(device: torch.device) -> str:
    """A device's readable name: the GPU's model (``NVIDIA H100 80GB HBM3``), else ``cpu``/``mps``."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def device_facts(setting: str) -> dict[str, str]:
    """What a step record and an MLflow run note of the device a step ran on: ``device`` (``cuda:0``)
    and ``device_name``."""
    device = resolve_device(setting)
    return {"device": str(device), "device_name": device_name(device)}


def use_deterministic(device: torch.device) -> None:
    """Ask torch for deterministic kernels on a GPU (cuBLAS needs its workspace fixed first): the same
    params and seed then give the same weights run after run on the same card and software."""
    import torch

    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def host_tensor(values: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` as a tensor: a tensor stays where it is; numpy arrays and lists become CPU tensors (data
    stay on the CPU, whatever torch's default device, and move to the compute device a batch at a time)."""
    import torch

    tensor = values if isinstance(values, torch.Tensor) else torch.as_tensor(values, device="cpu")
    return tensor if dtype is None else tensor.to(dtype)


# A split this small goes to an accelerator whole before training (batches are then cut there); a larger one
# stays on the CPU and goes a batch at a time.
RESIDENT_BYTES = 256 * 2**20


def resident(tensors: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``tensors`` on ``device`` at once when they are on the CPU, bound for an accelerator and together
    within :data:`RESIDENT_BYTES`; otherwise as they are (moved a batch at a time by :func:`to_device`)."""
    size = sum(t.numel() * t.element_size() for t in tensors)
    if device.type == "cpu" or size > RESIDENT_BYTES:
        return tensors
    return tuple(t.to(device) for t in tensors)


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on ``device``: a CPU batch bound for a GPU is pinned and copied without blocking."""
    if batch.device == device:
        return batch
    if device.type == "cuda" and batch.device.type == "cpu":
        return batch.pin_memory().to(device, non_blocking=True)
    return batch.to(device)


def module_device(module: Any) -> torch.device:
    """The device of a module's first parameter (the CPU for a module without any)."""
    import torch

    first = next(iter(module.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


AUTOCAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


@contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """Mixed precision for the forward pass and loss (``fp32``: none). The weights, their gradients and
    the optimizer's state stay in the model's dtype."""
    import torch

    if precision == "fp32":
        with nullcontext():
            yield
        return
    with torch.autocast(device.type, dtype=getattr(torch, AUTOCAST_DTYPES[precision])):
        yield


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """A gradient scaler for fp16 (its small range underflows gradients without one); None otherwise."""
    import torch

    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
