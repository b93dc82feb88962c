"""The user's own table of numeric features (loader: :mod:`mergeflow.data.table`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from mergeflow.schema.data_source import DataFiles, DataSource, LabelTask, Modality, register_source, require_path


class TableOptions(BaseModel):
    """Any ``datasets.load_dataset`` source: local csv/parquet/json files, or a hub name when online."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = None
    name: str | None = None
    data_files: DataFiles = None
    split: str = "train"
    feature_columns: list[str] | None = None
    label_column: str = "label"
    task: Literal["classification", "regression"] = "classification"
    group_column: str | None = None
    input_shape: list[int] | None = None


@register_source
class Table(DataSource):
    """The user's own table of numeric (or one-hot encoded) features, read with ``datasets``."""

    name = "table"
    aliases = ("hf",)
    Options = TableOptions
    implementation = "mergeflow.data.table:TableLoader"
    user_table = True
    reads_disk = True
    likely_causes = ("a label column that is not the target (data.table.label_column)",)
    shape_option = "input_shape"

    def task(self, options: TableOptions) -> LabelTask:
        return options.task

    def modality(self, options: TableOptions) -> Modality:
        return "image" if options.input_shape is not None and len(options.input_shape) > 1 else "features"

    def check_options(self, options: TableOptions) -> None:
        require_path(self.name, options)
