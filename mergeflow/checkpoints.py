"""Checkpoints as safetensors with the architecture in the header.

Models are never pickled: a checkpoint is a safetensors file whose metadata holds a JSON
model spec (see ``mergeflow.models.model_spec``) and any extra facts (data size, history).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from mergeflow.errors import MergeflowError
from mergeflow.files import atomic_path

_META_KEY = "mergeflow"


def save_checkpoint(path: str | Path, state: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    """Save a state dict as safetensors with ``meta`` (JSON) in the header, atomically.

    Tensors that share memory (tied weights, e.g. GPT-2's ``lm_head`` and ``wte``) are stored as
    copies: safetensors refuses shared storage, and loading gives each key its own tensor.
    """
    tensors, seen = {}, set()
    for key, value in state.items():
        tensor = value.detach().cpu().contiguous()
        address = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        tensors[key] = tensor.clone() if address in seen else tensor
        seen.add(address)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=checkpoint_header(meta))


def checkpoint_header(meta: Mapping[str, Any]) -> dict[str, str]:
    """The safetensors header metadata that carries ``meta`` (for writers other than ``save_checkpoint``)."""
    return {_META_KEY: json.dumps(dict(meta), sort_keys=True)}


def _refuse_non_safetensors(path: Path) -> None:
    """Safetensors files start with a little-endian u64 header length and then ``{``."""
    with path.open("rb") as f:
        head = f.read(9)
    size = path.stat().st_size
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= size - 8:
        return
    if head[:1] == b"\x80" or head[:2] == b"PK":
        raise MergeflowError(
            f"{path}: looks like a pickle/torch.save checkpoint; mergeflow never unpickles models. "
            "Convert it to safetensors (safetensors.torch.save_file) first"
        )
    raise MergeflowError(f"{path}: not a safetensors file (corrupt or truncated)")


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load a safetensors checkpoint and its metadata; clear errors for missing or corrupt files."""
    return _read_checkpoint(Path(path), tensors=True)


def load_checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's metadata (model spec, role, ...) from its header, without reading the tensors."""
    return _read_checkpoint(Path(path), tensors=False)[1]


def _read_checkpoint(path: Path, *, tensors: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if not path.is_file():
        raise MergeflowError(f"{path}: checkpoint not found")
    _refuse_non_safetensors(path)
    try:
        state = load_file(str(path)) if tensors else {}
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as error:
        raise MergeflowError(f"{path}: corrupt or truncated safetensors checkpoint ({error})") from None
    return state, json.loads(header.get(_META_KEY, "{}"))


def load_model(path: str | Path) -> torch.nn.Module:
    """Rebuild the model stored in a checkpoint (architecture from its metadata) in eval mode."""
    from mergeflow.models import build_from_spec

    state, meta = load_checkpoint(path)
    if "spec" not in meta:
        raise MergeflowError(f"{path}: checkpoint has no model spec in its metadata")
    model = build_from_spec(meta["spec"])
    model.load_state_dict(state)
    return model.eval()
