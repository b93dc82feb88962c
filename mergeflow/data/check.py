"""Checks of the user's own inputs before any orchestration starts: a table's columns, labels, missing
values and text; a pretrained transformer's tokenizer against its embeddings."""

from __future__ import annotations

from typing import Any


def check_source(data: dict[str, Any], seed: int = 0) -> None:
    """Read a ``hf`` or ``text`` source as the prepare step will and raise its ``DataError`` now.

    ``data`` is the params' ``data`` section. Built-in sources and WordNet (checked when the params
    are validated) are skipped: they are not the user's table.
    """
    source = data["source"]
    if source not in ("hf", "text"):
        return
    import datasets  # only for a table to read: `mergeflow validate` on a built-in source stays light

    from mergeflow.data.sources import load_raw
    from mergeflow.data.text import load_text

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a bad table gets one line, not progress bars before it
    try:
        if source == "hf":
            load_raw("hf", seed=seed, options=data["hf"], missing=data["missing"], categorical=data["categorical"])
        else:
            load_text("text", seed=seed, options=data["text"])
    finally:
        if shown:
            datasets.enable_progress_bars()


def check_inputs(params: Any) -> None:
    """Every pre-flight check that reads the user's files: the table (``check_source``), and for a pretrained
    transformer its tokenizer against its embeddings (``check_vocabulary``). ``params``: validated Params."""
    check_source(params.section("data"), params.seed)
    hf = params.model.hf
    if params.model.arch == "hf" and hf.pretrained:
        from mergeflow.data.tokenize import check_vocabulary, load_tokenizer

        check_vocabulary(load_tokenizer(hf.pretrained), hf.pretrained, hf.model_config_fields())
