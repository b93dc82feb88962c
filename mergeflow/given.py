"""Models given instead of made: what a ``finetune.checkpoints`` or ``pretrain.checkpoint`` source is, which files
of it are read, and the checks that need no torch (the files, their kind, the model family, an adapter's base).

A source is a string: the path of a mergeflow checkpoint (safetensors with its spec in the header:
:mod:`mergeflow.checkpoints`), of a Hugging Face model directory (``config.json`` beside ``model.safetensors`` or
its shards), of a PEFT LoRA adapter directory (``adapter_config.json`` and ``adapter_model.safetensors``), or a Hub
name, whose snapshot is downloaded when online (offline, only a cached one is used). Reading one into weights is
:mod:`mergeflow.given_weights`'s; this module imports neither torch nor transformers, so ``mergeflow validate``
checks the sources quickly.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergeflow.config import Params

MERGEFLOW = "mergeflow"  # a mergeflow checkpoint
HF_DIRECTORY = "hf_directory"  # a Hugging Face model directory
PEFT_LORA = "peft_lora"  # a PEFT LoRA adapter directory
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"  # as mergeflow.hf_checkpoints, without torch
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_META_KEY = "mergeflow"  # where a mergeflow checkpoint's header keeps its spec (mergeflow.checkpoints)
# What a Hub snapshot needs of a model or adapter repository (no other weights formats, no tokenizer).
_HUB_FILES = ["config.json", WEIGHTS, INDEX, "model-*.safetensors", ADAPTER_CONFIG, ADAPTER_WEIGHTS]
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class Given:
    """A source resolved on this machine: its params key, the string given, its kind, its local path (a Hub
    name's snapshot) and the files read of it (absolute paths: they key the step that reads it)."""

    key: str
    source: str
    kind: str
    path: Path
    files: tuple[str, ...]


def given_keys(params: Params) -> dict[str, str]:
    """Every given source by its params key: ``pretrain.checkpoint``, ``finetune.checkpoints.N`` and
    ``tasks.<task>.checkpoint``."""
    base = {"pretrain.checkpoint": params.pretrain.checkpoint} if params.pretrain.checkpoint is not None else {}
    return base | dict(params.given_clients.values())


def resolve(key: str, source: str, *, fetch: bool = True) -> Given | None:
    """The source on this machine, its kind and files; None for a Hub name not cached here when ``fetch`` is
    False (it is downloaded when the pipeline plans its step).

    Raises:
        ValueError: why the source cannot be used (missing, unknown format, a Hub name offline).
    """
    path = _local_path(source, fetch=fetch)
    if path is None:
        return None
    kind = detect_kind(path)
    return Given(key, source, kind, path, source_files(path, kind))


def _local_path(source: str, *, fetch: bool) -> Path | None:
    path = Path(source).expanduser()
    if path.exists():
        return path.resolve()
    if source.startswith((".", "/", "~")) or not _HUB_NAME.match(source):
        raise ValueError(f"{source}: no such file or directory")
    return _hub_snapshot(source, fetch=fetch)


def hub_offline() -> bool:
    """Whether huggingface_hub is told to stay offline (``HF_HUB_OFFLINE``)."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _hub_snapshot(name: str, *, fetch: bool) -> Path | None:
    """A Hub repository's snapshot of the files a given model needs: cached, or downloaded when ``fetch``."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, allow_patterns=_HUB_FILES, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        pass
    if hub_offline():
        raise ValueError(
            f"{name!r} is not a local path, and it cannot be downloaded (HF_HUB_OFFLINE is set); "
            "give a local file or directory"
        )
    if not fetch:
        return None
    try:
        return Path(snapshot_download(name, allow_patterns=_HUB_FILES))
    except Exception as error:  # noqa: BLE001 - any failure of the Hub or the network is this source's one line
        reason = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        raise ValueError(f"{name!r} is not a local path, and it cannot be downloaded ({reason})") from None


def detect_kind(path: Path) -> str:
    """``mergeflow``, ``hf_directory`` or ``peft_lora``.

    Raises:
        ValueError: for anything else (a pickle, a directory without safetensors weights, a bare safetensors file).
    """
    if path.is_dir():
        if (path / ADAPTER_CONFIG).is_file():
            return PEFT_LORA
        if (path / "config.json").is_file() and ((path / WEIGHTS).is_file() or (path / INDEX).is_file()):
            return HF_DIRECTORY
        found = (
            f"config.json but no {WEIGHTS}: pickled weights are never read"
            if (path / "config.json").is_file()
            else "no config.json"
        )
        raise ValueError(
            f"{path}: not a Hugging Face model directory ({found}) nor a PEFT adapter directory (no {ADAPTER_CONFIG})"
        )
    _, metadata = read_header(path)
    if _META_KEY not in metadata:
        raise ValueError(
            f"{path}: a safetensors file without a mergeflow spec in its header; give the Hugging Face model "
            "directory it belongs to (config.json beside it) instead"
        )
    return MERGEFLOW


def read_header(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """A safetensors file's tensor shapes by name and its metadata, from its header alone.

    Raises:
        ValueError: for a file that is not safetensors (a pickle, truncated).
    """
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > path.stat().st_size - 8:
                raise ValueError("header length beyond the end of the file")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not a safetensors file ({error}); mergeflow never unpickles models") from None
    metadata = header.pop("__metadata__", None) or {}
    return {name: tuple(entry["shape"]) for name, entry in header.items()}, metadata


def source_files(path: Path, kind: str) -> tuple[str, ...]:
    """The files read of a source (absolute paths): the checkpoint; a model directory's config, weights (or index
    and shards); an adapter's config and weights."""
    if kind == MERGEFLOW:
        return (str(path),)
    if kind == PEFT_LORA:
        return (str(path / ADAPTER_CONFIG), str(path / ADAPTER_WEIGHTS))
    if (path / INDEX).is_file():
        shards = sorted(set(_json(path / INDEX).get("weight_map", {}).values()))
        return (str(path / "config.json"), str(path / INDEX), *(str(path / shard) for shard in shards))
    return (str(path / "config.json"), str(path / WEIGHTS))


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not readable JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value


def given_files(params: Params) -> dict[str, tuple[str, ...]]:
    """The files read of each given source that is on this machine, by params key (a Hub name not cached yet has
    none); a source that cannot be used is left to :func:`given_problems`."""
    files = {}
    for key, source in given_keys(params).items():
        try:
            given = resolve(key, source, fetch=False)
        except ValueError:
            continue
        if given is not None:
            files[key] = given.files
    return files


def checkpoint_spec(path: Path) -> dict[str, Any]:
    """A mergeflow checkpoint's model spec, from its header."""
    return json.loads(read_header(path)[1][_META_KEY]).get("spec") or {}


def adapter_config(path: Path) -> dict[str, Any]:
    """A PEFT adapter directory's ``adapter_config.json``."""
    return _json(path / ADAPTER_CONFIG)


def given_problems(params: Params, *, fetch: bool = False) -> list[str]:
    """``key: why`` for every given source that cannot be used: not found, of an unknown format, a Hub name offline,
    of another model family or architecture, with other parameter names or shapes than the first given model
    (the base first), a base that is no mergeflow checkpoint, an adapter of another base (or of a base that this
    run trains further). Hub names not cached are downloaded when ``fetch``, else left to the run. What needs the
    data (a head for another number of classes, the base made here) is checked by the step that reads the source."""
    problems, reference = [], None
    for key, source in given_keys(params).items():
        try:
            given = resolve(key, source, fetch=fetch)
            if given is None:
                continue
            _check_kind(params, given)
            if given.kind != PEFT_LORA:
                layout = tensor_layout(given)
                if reference is None:
                    reference = (key, layout)
                else:
                    # A multi-task run's clients have heads of their own sizes: their step checks each against its
                    # task's base.
                    _check_same_layout(layout, *reference, shapes=not params.multitask)
        except ValueError as error:
            problems.append(f"{key}: {error}")
    return problems


def tensor_layout(given: Given) -> dict[str, tuple[int, ...]]:
    """The shapes of a checkpoint's or model directory's tensors by name, from the headers of its files."""
    layout: dict[str, tuple[int, ...]] = {}
    for file in given.files:
        if file.endswith(".safetensors"):
            layout |= read_header(Path(file))[0]
    return layout


def _check_same_layout(
    layout: dict[str, tuple[int, ...]], key: str, reference: dict[str, tuple[int, ...]], shapes: bool = True
) -> None:
    """Raise ValueError unless ``layout`` has ``reference``'s names (below a common prefix) and, with ``shapes``, its
    shapes."""
    prefix, theirs = common_prefix(reference, layout), ""
    if not prefix:
        theirs = common_prefix(layout, reference)
    mine = {name.removeprefix(theirs): shape for name, shape in layout.items()}
    names = {prefix + name: shape for name, shape in mine.items()}
    missing = [name for name in reference if name not in names]
    unknown = [name for name in names if name not in reference]
    if missing or unknown:
        first = (missing or unknown)[0]
        raise ValueError(
            f"its parameter names are not those of {key} ({len(missing)} missing, {len(unknown)} unknown: {first}, …)"
        )
    for name, shape in names.items() if shapes else ():
        if shape != reference[name]:
            raise ValueError(f"{name} has shape {shape}, and {key}'s {reference[name]}")


def common_prefix(ours: Iterable[str], names: Iterable[str]) -> str:
    """The prefix below which ``ours`` holds the most of ``names`` (a wrapper's, such as ``model.``; empty when none
    fits better)."""
    ours, names = set(ours), set(names)
    candidates = {""}
    for key in ours:
        candidates |= {key[: len(key) - len(name)] for name in names if key.endswith("." + name)}
        if len(candidates) > 1:
            break
    return max(sorted(candidates), key=lambda prefix: sum(prefix + name in ours for name in names))


def _check_kind(params: Params, given: Given) -> None:
    """Raise ValueError if the run's model family or base rule the source out."""
    family = params.model.family
    if given.kind == MERGEFLOW:
        _check_spec(params, checkpoint_spec(given.path))
        return
    if given.key == "pretrain.checkpoint":
        where = f"as {family.pretrained_key}" if family.pretrained_key else "as a client (finetune.checkpoints)"
        raise ValueError(f"a base is a mergeflow checkpoint; give a {given.kind.replace('_', ' ')} {where}")
    if not family.pretrained_key:
        raise ValueError(f"a {given.kind.replace('_', ' ')} needs model.arch transformers, not {params.model.arch!r}")
    if given.kind == PEFT_LORA:
        _check_adapter(params, given)


def _check_spec(params: Params, spec: dict[str, Any]) -> None:
    """A mergeflow checkpoint's spec is of the run's model: its family, and the values of the ``model`` keys it
    records (``arch``, an MLP's ``widths`` and ``activation``)."""
    from mergeflow.schema.families import family_of_arch

    if "arch" not in spec:
        raise ValueError("its header holds no model spec")
    try:
        family = family_of_arch(spec["arch"]).name
    except ValueError:
        family = None
    if family != params.model.family.name:
        raise ValueError(f"a model of arch {spec['arch']!r}, and model.arch is {params.model.arch!r}")
    model = params.section("model")
    for key, value in model.items():
        if key in spec and not isinstance(value, dict) and spec[key] != value:
            raise ValueError(f"a model of {key} {spec[key]!r}, and model.{key} is {value!r}: another architecture")


def _check_adapter(params: Params, given: Given) -> None:
    """A LoRA adapter names the run's base, which this run uses as it is."""
    config = adapter_config(given.path)
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        kind = "DoRA" if config.get("use_dora") else config.get("peft_type")
        raise ValueError(f"{given.path}: a {kind} adapter; only LoRA adapters are folded")
    bases = {name for name in (params.pretrained, params.pretrain.checkpoint) if name}
    if not bases:
        raise ValueError(
            "an adapter folds onto its base; give that base "
            f"({params.model.family.pretrained_key} or pretrain.checkpoint)"
        )
    named = config.get("base_model_name_or_path")
    if named and not any(_same_model(named, base) for base in bases):
        raise ValueError(f"an adapter of {named!r}, and this run's base is {' or '.join(sorted(bases))!r}")
    pretraining = params.pretrain
    if pretraining.checkpoint is None and (pretraining.language_model or (pretraining.enabled and pretraining.epochs)):
        raise ValueError(
            "an adapter folds onto the pretrained model, which pretrain would train further here; "
            "set pretrain.enabled: false (or give the base as pretrain.checkpoint)"
        )


def _same_model(a: str, b: str) -> bool:
    """Whether two names of a model are the same: equal, or the same local path."""
    if a == b:
        return True
    first, second = Path(a).expanduser(), Path(b).expanduser()
    return first.exists() and second.exists() and first.resolve() == second.resolve()
