"""The ``merge`` section: the merges to run and their options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from mergeflow.config.entry_variants import check_variants, resolve_variant
from mergeflow.config.section import Section


@dataclass(frozen=True)
class MergeEntry:
    """One entry of ``merge.methods``: its ``method`` and the validated options of each merge it runs, one
    for a plain merge or one per candidate of a search (``searched``: the options given as lists)."""

    method: str
    candidates: tuple[BaseModel, ...]
    searched: tuple[str, ...] = ()


class MergeConfig(Section):
    """The merges to run. Each name in ``methods`` is a registered method, or a variant
    declared in ``options`` with a ``method`` key (e.g. ``ssf_20: {method: ssf, mask_rate: 0.2}``),
    so one method can run with several settings side by side.
    """

    methods: list[str] = ["average", "weighted", "task_arithmetic"]
    options: dict[str, dict[str, Any]] = {}
    select_by: Literal["auto", "accuracy", "nll", "mse"] = "auto"
    # Tensor-scope merges of client checkpoints larger than this stream from the files, tensor by tensor
    # (mergeflow.merge.streaming), never holding the K models; 0 streams always. Same result either way.
    stream_above_mb: float = Field(256, ge=0)

    def method_of(self, name: str) -> str:
        """The registered method of one entry of ``methods``."""
        return resolve_variant(self.options, name, "method")[0]

    def resolve(self, name: str) -> MergeEntry:
        """The method of one entry of ``methods`` and its validated options: a search's options hold lists,
        valid options only once the grid is expanded, so each candidate is validated on its own."""
        from mergeflow.schema.merge import validate_options
        from mergeflow.schema.search import search_grid

        method, options = resolve_variant(self.options, name, "method")
        candidates = tuple(validate_options(method, candidate) for candidate in search_grid(options))
        return MergeEntry(method, candidates, self.searched(name))

    def searched(self, name: str) -> tuple[str, ...]:
        """The options of one entry of ``methods`` that are searches (given as lists); () for a plain merge."""
        from mergeflow.schema.search import searched_keys

        return tuple(searched_keys(resolve_variant(self.options, name, "method")[1]))

    def selection_metric(self, task: str) -> str:
        """The validation metric searches are chosen by: ``select_by``, or accuracy (classification) / NLL."""
        from mergeflow.schema.objectives import declared_objective

        return self.select_by if self.select_by != "auto" else declared_objective(task).select_by[0]

    @model_validator(mode="after")
    def _known_methods_and_options(self) -> MergeConfig:
        from mergeflow.schema.merge import DECLARED, validate_options
        from mergeflow.schema.search import search_grid

        def validate_search(method: str, options: dict[str, Any]) -> None:
            for candidate in search_grid(options, prefix=f"merge.options.{method}."):
                validate_options(method, candidate)

        check_variants(
            self.methods,
            self.options,
            list_key="methods",
            kind_key="method",
            known=DECLARED,
            validate=validate_search,
            error_prefix="merge.options",
        )
        return self
