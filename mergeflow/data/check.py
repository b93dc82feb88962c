"""Checks of the user's own inputs before any orchestration starts: a table's columns, labels, missing
values and text; a pretrained transformer's tokenizer against its embeddings."""

from __future__ import annotations

from typing import Any

from mergeflow.schema.sources import get_source


def check_source(data: dict[str, Any], seed: int = 0) -> None:
    """Read the user's table (a source with ``user_table``) as the prepare step will, and raise its
    ``DataError`` now.

    ``data`` is the params' ``data`` section as the prepare step reads it
    (:meth:`mergeflow.config.DataConfig.for_prepare`). Other sources (built-in sets, WordNet: checked by
    the pre-flight) are skipped: they are not the user's table.
    """
    source = get_source(data["source"])
    if not source.user_table:
        return
    import datasets  # only for a table to read: `mergeflow validate` on a built-in source stays light

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a bad table gets one line, not progress bars before it
    try:
        source.loader.check(source.parse(data[source.name]), seed=seed, data=data)
    finally:
        if shown:
            datasets.enable_progress_bars()


def check_inputs(params: Any) -> None:
    """Every pre-flight check that reads the user's files: the table (``check_source``), and for a pretrained
    transformer its tokenizer against its embeddings (``check_vocabulary``). ``params``: validated Params."""
    for task in params.task_names:
        check_source(params.task_data(task).for_prepare(), params.seed)
    if params.pretrained:  # a pretrained model's family is one over token ids
        from mergeflow.data.tokenize import check_vocabulary, load_tokenizer

        overrides = params.model.transformers.model_config_fields()
        check_vocabulary(load_tokenizer(params.pretrained), params.pretrained, overrides)
