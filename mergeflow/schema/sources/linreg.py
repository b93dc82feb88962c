"""Synthetic Bayesian linear regression (loader: :mod:`mergeflow.data.linreg`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from mergeflow.schema.data_source import DataSource, LabelTask, register_source


class LinregOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int = Field(1000, ge=2)
    dim: int = Field(10, ge=1)
    noise_std: float = Field(0.5, gt=0)
    prior_std: float = Field(1.0, gt=0)


@register_source
class Linreg(DataSource):
    """Synthetic Bayesian linear regression with known truth."""

    name = "linreg"
    Options = LinregOptions
    implementation = "mergeflow.data.linreg:LinregLoader"

    def task(self, options: LinregOptions) -> LabelTask:
        return "regression"

    def known_rows(self, options: LinregOptions) -> int:
        return options.n
