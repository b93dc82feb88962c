"""What a pipeline's MLflow runs say about their params: the params in use, the data's name, and a run name
that tells runs apart in the runs table without configuring columns (MLflow's table shows no param column
until one is chosen)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mergeflow.config import Params

_NAMED_CHANGES = 4  # changed params spelled out in a run's name; the rest are counted


def data_label(params: Params) -> str:
    """A short name of the data: the source, or for a table or text source its file's (or dataset's) name."""
    options = params.data.options.model_dump(mode="json")
    files = options.get("data_files")
    if isinstance(files, dict):
        files = next(iter(files.values()), None)
    if isinstance(files, list):
        files = files[0] if files else None
    named = files or options.get("path") or options.get("root")
    label = Path(str(named)).stem if named and params.data.source in ("table", "text") else params.data.source
    return re.sub(r"[^\w.-]", "_", label) or params.data.source


def params_in_use(params: Params) -> dict[str, Any]:
    """The params that shape this pipeline's results, nested: the chosen source's options but no other
    source's, the tokenizer and transformer settings only for a transformer, the options of the merges and
    algorithms that run, and no unset (null or empty) values. Orchestration (how, not what) is left out."""
    config = params.model_dump(mode="json", exclude={"orchestration"})
    transformer = params.model.arch == "transformers"
    data = config["data"]
    for key in [key for key in data if isinstance(data[key], dict) and key != params.data.source]:
        if key != "tokenizer" or not transformer:
            del data[key]
    if not transformer:
        config["model"].pop("transformers", None)
    config["merge"]["options"] = {k: v for k, v in config["merge"]["options"].items() if k in params.merge.methods}
    federated = config["federated"]
    federated["options"] = {k: v for k, v in federated["options"].items() if k in params.federated.algorithms}
    return _without_unset(config)


def _without_unset(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    kept = {key: _without_unset(value) for key, value in node.items()}
    return {key: value for key, value in kept.items() if value not in (None, {}, [])}


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested params as ``a.b.c`` keys with string values, for ``log_params``."""
    flat: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = json.dumps(value) if not isinstance(value, str) else value
    return flat


def changed_params(mine: dict[str, str], before: dict[str, str]) -> dict[str, str]:
    """The flat params (:func:`flatten`) of ``mine`` that ``before`` had with another value or lacked, but for the
    options of a merge or algorithm ``before`` did not run (they come with the changed ``merge.methods``)."""
    known = {".".join(key.split(".")[:depth]) for key in before for depth in range(1, key.count(".") + 1)}

    def explained(key: str) -> bool:
        parts = key.split(".")
        return "options" in parts[:-2] and ".".join(parts[: parts.index("options") + 2]) not in known

    return {key: value for key, value in mine.items() if before.get(key) != value and not explained(key)}


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


def registered_model_name(experiment: str, data: str, merge: str) -> str:
    """The Model Registry name of one merge entry: one registered model per experiment, data and merge, so that
    the versions of a name take the same inputs (another table's model is another model, not a new version)."""
    return f"{experiment}.{data}.{merge}"
