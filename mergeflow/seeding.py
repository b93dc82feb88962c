"""Per-task seeds derived from the global seed, so no task depends on another's RNG use."""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, *labels: object) -> int:
    """A 63-bit seed from the global seed and labels such as ("finetune", client_id)."""
    text = ":".join([str(seed), *map(str, labels)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1
