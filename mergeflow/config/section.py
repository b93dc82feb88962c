"""The base of every params section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A params section: a misspelt key is an error that names it."""

    model_config = ConfigDict(extra="forbid")
