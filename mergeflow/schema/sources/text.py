"""The user's own text classification table (loader: :mod:`mergeflow.data.text`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from mergeflow.schema.data_source import DataFiles, DataSource, Modality, register_source, require_path


class TextOptions(BaseModel):
    """A text classification table for ``datasets.load_dataset``: local csv/json/parquet, or a hub name
    when online. ``text_pair_column`` makes it a sentence-pair task (NLI-style)."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = None
    name: str | None = None
    data_files: DataFiles = None
    split: str = "train"
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    group_column: str | None = None


@register_source
class Text(DataSource):
    """The user's own text classification table (or sentence pairs), tokenized before partitioning."""

    name = "text"
    Options = TextOptions
    implementation = "mergeflow.data.text:TextLoader"
    user_table = True
    reads_disk = True
    likely_causes = ("a label column that is not the target (data.text.label_column)",)

    def modality(self, options: TextOptions) -> Modality:
        return "tokens"

    def check_options(self, options: TextOptions) -> None:
        require_path(self.name, options)
