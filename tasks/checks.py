"""What the pipeline checks of the user's inputs before any work, torch-free: the local data files
the source reads (they key the prepare step and the plans), and the reading of the user's table and
pretrained model (:func:`check_data`, skipped when the same files already passed)."""

from __future__ import annotations

import json
from pathlib import Path

from mergeflow.config import DataConfig, Params
from tasks.store import STATE_DIR, file_signature

CHECKED = f"{STATE_DIR}/checked"  # markers of tables that passed the pre-flight check


def local_data_files(params: Params, data: DataConfig | None = None) -> tuple[str, ...]:
    """The local files the data source reads (glob patterns expanded), so that editing one re-runs prepare;
    ``data``: a task's data section instead of the params' own."""
    import glob

    data = data or params.data
    local = [f for f in data.declaration.data_files(data.options) if "://" not in f]
    return tuple(sorted({str(Path(p).expanduser()) for f in local for p in (glob.glob(f) or [f])}))


def check_data(params: Params, root: Path) -> None:
    """The pre-flight checks of the user's files (``check_inputs``: the table, a pretrained transformer's
    tokenizer against its embeddings), before any orchestration.

    It is skipped when the same data and model options already passed on the same local files (by
    path, size and modification time); a table with remote files is checked every time.
    """
    import hashlib

    from mergeflow.data.check import check_inputs

    datas = [params.task_data(task) for task in params.task_names]
    data = [section.for_prepare() for section in datas]
    table = any(section.declaration.user_table for section in datas)
    pretrained = params.pretrained
    if not table and not pretrained:
        return
    tables = [file for section in datas for file in local_data_files(params, section)] if table else []
    local = [*tables, *(_model_files(pretrained) if pretrained else ())]
    marker = None
    remote = table and any("://" in f for d in datas for f in d.declaration.data_files(d.options))
    if not remote and all(Path(f).is_file() for f in local):
        signatures = [file_signature(Path(f)) for f in local]
        checked = {
            "data": data,
            "model": params.section("model.transformers"),
            "seed": params.seed,
            "files": signatures,
        }
        payload = json.dumps(checked, sort_keys=True)
        marker = root / CHECKED / hashlib.sha256(payload.encode()).hexdigest()
        if marker.is_file():
            return
    check_inputs(params)
    if marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()


def _model_files(pretrained: str) -> list[str]:
    """A local pretrained model's config and tokenizer files (none for a hub name)."""
    directory = Path(pretrained).expanduser()
    if not directory.is_dir():
        return []
    return sorted(str(p) for p in directory.iterdir() if p.suffix in (".json", ".txt", ".model", ".jinja"))
