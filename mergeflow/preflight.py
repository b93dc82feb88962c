"""Checks of what the params point at on disk and on the network, once per command, before any work.

The params schema (:mod:`mergeflow.config`) does no I/O: it validates values and the rules that
span sections, so it can run inside the flow and at every sweep point for free. What the params
name outside themselves is checked here, each problem one line that names its key:

- :func:`check_paths`: what the data source reads (its ``preflight``: a table's local files, the
  WordNet database), a pretrained model's directory (or, for a hub name, its cache or the Hub), the
  models given instead of made (:func:`mergeflow.given.given_problems`); no torch, so ``mergeflow
  validate`` stays fast;
- :func:`check_model`: LoRA target modules against the model's architecture, built on the meta
  device (it imports torch and transformers, so ``mergeflow run`` does it and ``validate`` does not),
  the device and precision the params ask for (:func:`check_device`), and given models named on the
  Hub, downloaded now.

The reading of the user's table itself (columns, labels, missing values) is
:func:`mergeflow.data.check.check_inputs`'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mergeflow.config import Params
from mergeflow.errors import ConfigError
from mergeflow.given import given_problems


def check_paths(params: Params, source: str = "params") -> None:
    """The local files, WordNet and pretrained model the params name exist (or can be downloaded).

    Raises:
        ConfigError: one line per problem, ``source: key: problem``.
    """
    lines = [f"{source}: {problem}" for task in params.task_names for problem in _data_problems(params, task)]
    if params.pretrained:
        problem = pretrained_problem(params.pretrained)
        if problem:
            lines.append(f"{source}: {params.model.family.pretrained_key}: {problem}")
        else:
            lines += [f"{source}: {line}" for line in _alignment_problems(params)]
    lines += [f"{source}: {problem}" for problem in given_problems(params)]
    if lines:
        raise ConfigError(lines)


def _data_problems(params: Params, task: str | None) -> list[str]:
    """The problems of a task's data source (of ``data``, for None), each naming its key (``tasks.<task>.data.…``)."""
    data = params.task_data(task)
    problems = data.declaration.preflight(data.options)
    return problems if task is None else [f"tasks.{task}.{problem}" for problem in problems]


def check_model(params: Params, source: str = "params") -> None:
    """LoRA's target modules name modules of the model (built on the meta device: no weights, no memory).

    Raises:
        ConfigError: naming ``finetune.lora.target_modules``, ``orchestration.device``, ``finetune.precision`` or a
            given model that cannot be downloaded.
    """
    check_device(params, source)
    problems = given_problems(params, fetch=True)
    if problems:
        raise ConfigError([f"{source}: {problem}" for problem in problems])
    if params.finetune.lora is None:  # the schema allows LoRA only for a family of language models
        return
    from mergeflow.models.lora import missing_modules

    hf = params.model.transformers
    missing = missing_modules(hf.pretrained, hf.model_config_fields(), params.finetune.lora.target_modules, hf.task)
    if missing:
        raise ConfigError([f"{source}: finetune.lora.target_modules: {missing} match no module of the model"])


def check_device(params: Params, source: str = "params") -> None:
    """This machine has the device ``orchestration.device`` names (``cuda:3`` on a one-GPU machine does not),
    and it supports ``finetune.precision`` (bf16 on a GPU without it does not). Imports torch only for an
    accelerator or a reduced precision.

    Raises:
        ConfigError: one line naming the key.
    """
    from mergeflow.device import device_problem

    problem = device_problem(params.orchestration.device, params.finetune.precision)
    if problem:
        raise ConfigError([f"{source}: {problem}"])


def _alignment_problems(params: Params) -> list[str]:
    """``align.method``: a local pretrained model's type has a permutation spec (read from its config.json)."""
    config = Path(str(params.pretrained)).expanduser() / "config.json"
    if params.align.method == "none" or not config.is_file():
        return []
    from mergeflow.schema.families import check_alignable

    try:
        check_alignable(str(json.loads(config.read_text()).get("model_type")))
    except ValueError as error:
        return [str(error)]
    return []


def pretrained_problem(name: str) -> str | None:
    """Why ``name`` is not a usable transformers model: a local directory must hold one; a hub name must
    be cached, or the Hub reachable (asked once, with a 10 s timeout). None when it is usable."""
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")):
        return (
            None
            if (path / "config.json").is_file()
            else f"{name} is not a transformers model directory (no config.json)"
        )
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return None
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        reason = "HF_HUB_OFFLINE is set"
    else:
        reason = _hub_unreachable(name)
    if reason is None:
        return None
    return (
        f"{name!r} is not a local directory, and it cannot be downloaded ({reason}); "
        "give the path of a local model directory"
    )


def _hub_unreachable(name: str) -> str | None:
    """Why ``name`` cannot be downloaded from the Hub now, or None when it can."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        HfApi().model_info(name, timeout=10)
    except RepositoryNotFoundError:
        return "no such model on the Hugging Face Hub, or it is private"
    except HfHubHTTPError as error:
        return f"the Hugging Face Hub answered {str(error).splitlines()[0][:120]}"
    except (httpx.HTTPError, OSError) as error:
        return f"no connection to the Hugging Face Hub: {str(error).splitlines()[0][:120]}"
    return None
