"""Entries of ``merge.methods`` and ``federated.algorithms``: a registered name, or a variant declared under
the section's ``options`` with a kind key (``method``, ``algorithm``)."""

from __future__ import annotations

from typing import Any

from mergeflow.errors import ConfigError, did_you_mean


def resolve_variant(options: dict[str, dict[str, Any]], name: str, kind_key: str) -> tuple[str, dict[str, Any]]:
    """A list entry's registered name and options: ``name`` itself, or a variant with a ``kind_key``."""
    chosen = dict(options.get(name, {}))
    return str(chosen.pop(kind_key, name)), chosen


def check_variants(
    entries: list[str],
    options: dict[str, dict[str, Any]],
    *,
    list_key: str,
    kind_key: str,
    known: dict[str, Any],
    validate: Any,
    error_prefix: str,
) -> None:
    """Every listed entry is registered or a declared variant; every option set validates.

    Shared by ``merge.methods`` and ``federated.algorithms``; raises ValueError naming the key.
    ``known`` is the torch-free schema (``mergeflow.schema``), so validating imports no torch.
    """
    for name, chosen in options.items():
        kind = chosen.get(kind_key, name)
        if kind not in known:
            key = f"options.{name}.{kind_key}" if kind_key in chosen else f"options.{name}"
            raise ValueError(
                f"{key}: unknown {kind_key} {kind!r}{did_you_mean(kind, known)}; known: {', '.join(known)}"
            )
        try:
            validate(kind, resolve_variant(options, name, kind_key)[1])
        except ConfigError as error:
            detail = error.lines[0].removeprefix(f"{error_prefix}.{kind}.")
            raise ValueError(f"options.{name}.{detail}") from None
    for i, name in enumerate(entries):
        if name not in known and name not in options:
            raise ValueError(
                f"{list_key}[{i}]: unknown {kind_key} {name!r}{did_you_mean(name, [*known, *options])}; "
                f"known: {', '.join(known)} "
                f"(or declare a variant under {error_prefix} with a '{kind_key}' key)"
            )
    if len(set(entries)) != len(entries):
        raise ValueError(f"{list_key}: an entry is listed twice")
