"""Frequent Directions (Liberty 2013; Ghashami et al. 2016): a low-rank sketch of a stream of rows.

Rows a_i of a matrix A (N × D) arrive in blocks; the sketch keeps at most ``2ℓ`` rows B with

    0 ⪯ AᵀA − BᵀB ⪯ Δ·I,   Δ = Σ of the shrinkages ≤ ‖A − A_k‖²_F / (ℓ + 1 − k) for every k ≤ ℓ,

in ``2ℓ × D`` memory whatever N is. Whenever the buffer is full, an SVD B = UΣVᵀ shrinks every
squared singular value by the (ℓ+1)-th largest one, which keeps at most ℓ rows. Mergeflow
sketches per-example Fisher scores with it: the low-rank part of a client's Fisher then sees every
example, within a memory budget, instead of a subset small enough to keep whole.
"""

from __future__ import annotations

import torch

_COLUMNS = 1 << 16  # columns widened to float64 at once


class FrequentDirections:
    """A sketch of at most ``rows`` directions (``2·rows`` buffered) of a stream of ``dim``-wide rows.

    Attributes:
        shrinkage: Δ, the total squared singular value removed so far: ‖AᵀA − BᵀB‖₂ ≤ Δ.
        seen: rows inserted so far.
    """

    def __init__(
        self, rows: int, dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        if rows < 1:
            raise ValueError(f"a Frequent Directions sketch needs at least one row, got {rows}")
        self.rows = rows
        self._buffer = torch.zeros(2 * rows, dim, dtype=dtype, device=device)
        self._filled = 0
        self.shrinkage = 0.0
        self.seen = 0

    def insert(self, block: torch.Tensor) -> None:
        """Add the rows of ``block`` (n × dim)."""
        self.seen += len(block)
        start = 0
        while start < len(block):
            if self._filled == len(self._buffer):
                self._shrink()
            take = min(len(self._buffer) - self._filled, len(block) - start)
            self._buffer[self._filled : self._filled + take] = block[start : start + take]
            self._filled += take
            start += take

    def _shrink(self) -> None:
        # The SVD through the small side: eigenvectors of the 2ℓ × 2ℓ Gram of the buffered rows, in
        # float64, widening a block of columns at a time so no float64 copy of the buffer is made.
        buffer = self._buffer[: self._filled]
        gram = torch.zeros(len(buffer), len(buffer), dtype=torch.float64, device=buffer.device)
        for columns in torch.split(buffer, _COLUMNS, dim=1):
            wide = columns.to(torch.float64)
            gram += wide @ wide.T
        values, vectors = torch.linalg.eigh(gram)  # ascending
        values, vectors = values.flip(0).clamp_min(0), vectors.flip(1)
        delta = float(values[self.rows]) if len(values) > self.rows else 0.0  # keeps ℓ directions
        keep = int((values > delta).sum())
        # B' = Σ'Vᵀ with Σ'² = Σ² − δ, and Vᵀ = Σ⁻¹UᵀB: the new rows are (Σ'Σ⁻¹Uᵀ) B.
        mix = (vectors[:, :keep] * ((values[:keep] - delta) / values[:keep]).sqrt()).T
        rows = torch.cat([mix @ columns.to(torch.float64) for columns in torch.split(buffer, _COLUMNS, dim=1)], 1)
        self._buffer[:keep] = rows.to(self._buffer.dtype)
        self._buffer[keep:] = 0
        self._filled = keep
        self.shrinkage += delta

    def sketch(self) -> torch.Tensor:
        """B (at most ``rows`` × dim): the sketch shrunk to its ``rows`` largest directions."""
        if self._filled > self.rows:
            self._shrink()
        return self._buffer[: self._filled].clone()
