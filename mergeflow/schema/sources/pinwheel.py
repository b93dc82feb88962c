"""The synthetic 2-D pinwheel (loader: :mod:`mergeflow.data.pinwheel`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from mergeflow.schema.data_source import DataSource, register_source


class PinwheelOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    clusters: int = Field(5, ge=2)
    per_cluster: int = Field(1000, ge=1)
    radial_std: float = Field(0.3, gt=0)
    tangential_std: float = Field(0.05, gt=0)
    rate: float = 0.25


@register_source
class Pinwheel(DataSource):
    """The synthetic 2-D pinwheel; a class is an arm."""

    name = "pinwheel"
    Options = PinwheelOptions
    implementation = "mergeflow.data.pinwheel:PinwheelLoader"

    def known_rows(self, options: PinwheelOptions) -> int:
        return options.clusters * options.per_cluster
