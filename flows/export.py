"""``mergeflow export-lora``: a merged model of the workspace as a PEFT LoRA adapter over the run's base."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from mergeflow.errors import MergeflowError

ADAPTERS = "models/adapters"


def check_export_options(rank: int | None, energy: float | None) -> None:
    """One of ``--rank`` (≥ 1) and ``--energy`` (in (0, 1]), before anything is read."""
    if (rank is None) == (energy is None):
        raise MergeflowError("export-lora: give one of --rank and --energy")
    if rank is not None and rank < 1:
        raise MergeflowError(f"export-lora --rank must be at least 1, got {rank}")
    if energy is not None and not 0 < energy <= 1:
        raise MergeflowError(f"export-lora --energy must be in (0, 1], got {energy}")


def export_lora(root: Path, merge: str, out: Path | None, rank: int | None, energy: float | None) -> Path:
    """Write the adapter of merge ``merge`` (an entry of ``merge.methods``) to ``out``, its base model to ``out/base``.

    ``PeftModel.from_pretrained(AutoModelFor….from_pretrained(out / "base"), out)`` is then the merged
    model, to the truncation's error (exactly at full rank). The directory appears whole or not at all.
    """
    from mergeflow.checkpoints import load_checkpoint, load_checkpoint_meta
    from tasks.layout import BASE, TOKENIZER, merged_checkpoint

    check_export_options(rank, energy)
    path = root / merged_checkpoint(merge)
    if not path.is_file():
        made = sorted(p.stem for p in (root / merged_checkpoint("x")).parent.glob("*.safetensors"))
        raise MergeflowError(f"{path}: no merged model {merge!r} here (merged: {', '.join(made) or 'none'})")
    from mergeflow.models import family_of

    spec = load_checkpoint_meta(path)["spec"]
    family = family_of(spec["arch"])
    if not family.declaration.language_models:
        raise MergeflowError(f"export-lora: model.arch {spec['arch']} has no LoRA adapters (transformers models do)")
    from mergeflow.adapters import AdapterRankError, extract_lora
    from mergeflow.models.hf import transformers_state

    base_state = load_checkpoint(root / BASE)[0]
    base = family.from_spec(spec)
    base.load_state_dict(base_state)
    merged = transformers_state(load_checkpoint(path)[0])
    try:
        adapter = extract_lora(base.model, merged, rank=rank, energy=energy)
    except AdapterRankError as error:
        raise MergeflowError(f"export-lora --rank: {error}") from None
    out = (out or root / ADAPTERS / merge).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as scratch:
        work = Path(scratch) / "adapter"
        tokenizer = root / TOKENIZER
        family.export(spec, base_state, work / "base", {"tokenizer": tokenizer} if tokenizer.is_dir() else {})
        adapter.model.save_pretrained(work)
        config = json.loads((work / "adapter_config.json").read_text())
        (work / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": str(out / "base")}))
        (work / "extraction.json").write_text(
            json.dumps({"merge": merge, "ranks": adapter.ranks, "errors": adapter.errors, "saved": adapter.saved})
        )
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    worst = max(adapter.errors.values(), default=0.0)
    ranks = sorted(adapter.ranks.values()) or [0]
    print(
        f"mergeflow: wrote {out}: LoRA on {len(adapter.ranks)} modules (rank {ranks[0]}–{ranks[-1]}, largest "
        f"relative error {worst:.2e}), {len(adapter.saved)} stored whole; its base model in {out / 'base'}"
    )
    return out
