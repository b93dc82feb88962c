"""What a pipeline's MLflow runs say about their params: the params in use, the data's name, and a run name
that tells runs apart in the runs table without configuring columns (MLflow's table shows no param column
until one is chosen)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mergeflow.config import Params
from mergeflow.schema.data_source import files_listed
from mergeflow.schema.families import DECLARED as FAMILIES

_NAMED_CHANGES = 4  # changed params spelled out in a run's name; the rest are counted


_GENERIC_STEMS = {"train", "test", "validation", "valid", "dev", "data", "dataset", "all", "full"}


def data_label(params: Params) -> str:
    """A short name of the data: the source, or for a table or text source the name of its file (its folder's
    for a pattern or a split's file such as ``train.csv``), or of its dataset and configuration (``glue-sst2``)."""
    source = params.data.source
    options = params.data.options.model_dump(mode="json")
    files = files_listed(options.get("data_files")) if "data_files" in options else []
    if files:
        path = Path(files[0])
        generic = any(c in path.name for c in "*?[") or path.stem.lower() in _GENERIC_STEMS
        label = path.parent.name if generic and path.parent.name else path.stem
    elif options.get("path"):
        label = "-".join(str(part) for part in (Path(options["path"]).name, options.get("name")) if part)
    else:
        label = source
    label = re.sub(r"[^\w.-]", "_", label).strip("._-")
    return label if re.search(r"[A-Za-z0-9]", label) else source


def tasks_label(tasks: Iterable[str]) -> str:
    """The data's name in a multi-task run: its tasks' names joined by ``-`` (``low-high-parity``), so that its
    runs, and its merges' registered models, are named apart from a single-task run's on the same source."""
    return "-".join(tasks)


def params_in_use(params: Params) -> dict[str, Any]:
    """The params that shape this pipeline's results, nested: the chosen source's options but no other
    source's, the tokenizer only for a family whose models take tokens, the chosen family's options as it uses
    them but no other family's, the options of the merges and algorithms that run, and no unset (null or
    empty) values. Orchestration (how, not what) is left out."""
    config = params.model_dump(mode="json", exclude={"orchestration"})
    family = params.model.family
    data = config["data"]
    for key in [key for key in data if isinstance(data[key], dict) and key != params.data.source]:
        if key != "tokenizer" or family.inputs != "tokens":
            del data[key]
    config["align"] = params.align_settings.model_dump(mode="json")
    for other in FAMILIES:
        if other != family.name:
            config["model"].pop(other, None)
    if family.name in config["model"]:
        config["model"][family.name] = family.options_in_use(params.model.options)
    config["merge"]["options"] = {k: v for k, v in config["merge"]["options"].items() if k in params.merge.methods}
    federated = config["federated"]
    federated["options"] = {k: v for k, v in federated["options"].items() if k in params.federated.algorithms}
    return _without_unset(config)


def _without_unset(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    kept = {key: _without_unset(value) for key, value in node.items()}
    return {key: value for key, value in kept.items() if value is not None and value != {}}


_RUN_LISTS = {"merge": "merge.methods", "federated": "federated.algorithms"}  # whose entries have options


def changed_params(mine: dict[str, str], before: dict[str, str]) -> dict[str, str]:
    """The flat params (:func:`tasks.mlflow_logging.flatten`) of ``mine`` that ``before`` had with another value
    or lacked, then those ``before`` had and ``mine`` lacks (``unset``); but for the options of a merge or
    algorithm that the other run did not run (they come with the changed ``merge.methods`` or
    ``federated.algorithms``)."""

    def explained(key: str, other: dict[str, str]) -> bool:
        section, _, rest = key.partition(".options.")
        return section in _RUN_LISTS and bool(rest) and rest.split(".")[0] not in _names(other, _RUN_LISTS[section])

    changed = {k: v for k, v in mine.items() if before.get(k) != v and not explained(k, before)}
    return changed | {k: "unset" for k in before if k not in mine and not explained(k, mine)}


def _names(flat: dict[str, str], key: str) -> list[str]:
    """The names a flat list param holds (``merge.methods``), none where it is absent."""
    value = json.loads(flat.get(key, "[]"))
    return value if isinstance(value, list) else []


def run_name(label: str, mine: dict[str, str], before: dict[str, str] | None) -> str:
    """A pipeline run's name: the data's name, then the params changed since ``before`` (the flat params of the
    experiment's previous run on the same data; None for its first), each by its last two key parts
    (``task_arithmetic.scaling=0.5``), long values cut, past four a count."""
    changes = changed_params(mine, before) if before is not None else {}
    spelled = [f"{_short(key)}={_cut(value)}" for key, value in changes.items()]
    more = [f"+{len(spelled) - _NAMED_CHANGES} more"] if len(spelled) > _NAMED_CHANGES else []
    return " ".join([label, *spelled[:_NAMED_CHANGES], *more])


def _short(key: str) -> str:
    """A key's last two parts, three when the first of them is an index (``clients.1.lr``)."""
    parts = key.split(".")
    return ".".join(parts[-3:] if len(parts) > 2 and parts[-2].isdigit() else parts[-2:])


def _cut(value: str, width: int = 32) -> str:
    value = value.replace('"', "").replace(", ", ",")  # JSON lists as [a,b]
    return value if len(value) <= width else value[: width - 1] + "…"
