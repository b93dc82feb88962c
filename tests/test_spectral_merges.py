"""Karcher, TSV-M, Iso-C and Iso-CTS: closed forms worked by hand, the papers' equations in NumPy, bad options.

The side-by-side runs against mergekit 0.1.5 and FusionBench 0.2.33 are in bench/spectral_peers.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import make_workspace, pipeline_params

from flows.cli import main
from mergeflow.errors import MergeflowError
from mergeflow.merge import merge
from mergeflow.merge.isotropic import subspace_sizes
from mergeflow.merge.karcher import karcher_coefficients


def _tensor(array) -> torch.Tensor:
    return torch.as_tensor(np.asarray(array, dtype=np.float64))


def _rotations(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return np.linalg.qr(rng.normal(size=(4, 4)))[0], np.linalg.qr(rng.normal(size=(4, 4)))[0]


def _spectral_case(*diagonals, seed: int = 0):
    """A base and models base + Q diag(d) Rᵀ: task matrices with known singular vectors (Q, R) and values."""
    q, r = _rotations(seed)
    base = np.arange(16, dtype=np.float64).reshape(4, 4) / 10
    states = [
        {"w": _tensor(base + q @ np.diag(d) @ r.T), "b": _tensor([float(i), 1.0])} for i, d in enumerate(diagonals)
    ]
    return {"w": _tensor(base), "b": _tensor([0.0, 0.0])}, states, q, r, base


def test_karcher_of_two_is_the_mean_norm_times_the_geodesic_midpoint():
    a = {"w": torch.tensor([3.0, 0.0, 0.0], dtype=torch.float64)}
    b = {"w": torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)}
    # unit directions e1 and (e2+e3)/√2 at 90°: midpoint (e1 + (e2+e3)/√2)/√2, mean norm (3 + √2)/2
    midpoint = torch.tensor([1.0, 1 / math.sqrt(2), 1 / math.sqrt(2)], dtype=torch.float64) / math.sqrt(2)
    torch.testing.assert_close(merge("karcher", [a, b])["w"], (3 + math.sqrt(2)) / 2 * midpoint)
    same_norm = {"w": b["w"] * 3 / math.sqrt(2)}  # equal norms: SLERP at t = ½ itself
    torch.testing.assert_close(merge("karcher", [a, same_norm])["w"], merge("slerp", [a, same_norm], t=0.5)["w"])


def test_karcher_of_three_is_a_critical_point_of_the_squared_angles():
    generator = torch.Generator().manual_seed(1)
    states = [{"w": torch.randn(5, 3, generator=generator, dtype=torch.float64) + 1.0} for _ in range(3)]
    merged = merge("karcher", states, max_iter=200, tol=1e-12, weights=[1, 2, 3], by_size=True)["w"].reshape(-1)
    units = [s["w"].reshape(-1) / s["w"].norm() for s in states]
    u = merged / merged.norm()
    gradient = sum(
        w * (math.acos(float(u @ e)) / math.sin(math.acos(float(u @ e)))) * (e - (u @ e) * u)
        for w, e in zip([1 / 6, 2 / 6, 3 / 6], units, strict=True)
    )
    assert float(gradient.norm()) < 1e-9  # Σ a_k log_u(u_k) = 0: the weighted Karcher mean
    assert math.isclose(
        float(merged.norm()), sum(w * float(s["w"].norm()) for w, s in zip([1 / 6, 2 / 6, 3 / 6], states, strict=True))
    )
    uniform = merge("karcher", states, max_iter=200, tol=1e-12, weights=[1, 2, 3])["w"]  # by_size off: uniform
    assert not torch.allclose(uniform.reshape(-1), merged)


def test_karcher_leaves_zero_tensors_out_of_the_direction_but_in_the_norm():
    gram = torch.tensor([[4.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 4.0]], dtype=torch.float64)
    c = karcher_coefficients(gram, torch.full((3,), 1 / 3, dtype=torch.float64), 10, 1e-5)
    # directions e1, e3 at 90°: midpoint (e1+e3)/√2 = Σ c_k x_k with x = 2e1, 0, 2e3; scale (2+0+2)/3
    torch.testing.assert_close(c, torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64) * (4 / 3) / (2 * math.sqrt(2)))


def test_tsv_with_orthogonal_task_subspaces_keeps_each_tasks_top_half_worked_by_hand():
    base, states, q, r, base_np = _spectral_case([4.0, 3.0, 2.0, 1.0], [0.1, 0.2, 5.0, 4.0])
    # K = 2 keeps 2 of 4 triplets each: task 1 (q1, q2; 4, 3), task 2 (q3, q4; 5, 4); already orthonormal
    merged = merge("tsv", states, base=base, scaling=0.5)
    torch.testing.assert_close(merged["w"], _tensor(base_np + 0.5 * q @ np.diag([4.0, 3.0, 5.0, 4.0]) @ r.T))
    torch.testing.assert_close(merged["b"], torch.tensor([0.25, 0.5], dtype=torch.float64))  # α·mean of non-matrices


def test_tsv_whitens_overlapping_tasks_as_the_papers_equations():
    rng = np.random.default_rng(3)
    base_np = rng.normal(size=(6, 4))
    tasks = [rng.normal(size=(6, 4)) + 2 * np.outer(np.ones(6), np.ones(4)) for _ in range(3)]  # a shared direction
    keep = 2  # rank_fraction 0.5 of min(6, 4)
    svds = [np.linalg.svd(t, full_matrices=False) for t in tasks]
    u = np.concatenate([s[0][:, :keep] for s in svds], axis=1)
    sigma = np.concatenate([s[1][:keep] for s in svds])
    v = np.concatenate([s[2][:keep].T for s in svds], axis=1)
    pu, _, quh = np.linalg.svd(u, full_matrices=False)  # U⊥ = P Qᵀ (Gargiulo et al., eq. for the whitening)
    pv, _, qvh = np.linalg.svd(v, full_matrices=False)
    expected = base_np + 0.7 * (pu @ quh) @ np.diag(sigma) @ (pv @ qvh).T
    states = [{"w": _tensor(base_np + t)} for t in tasks]
    merged = merge("tsv", states, base={"w": _tensor(base_np)}, scaling=0.7, rank_fraction=0.5)["w"]
    torch.testing.assert_close(merged, _tensor(expected))
    unwhitened = base_np + 0.7 * u @ np.diag(sigma) @ v.T
    assert np.abs(expected - unwhitened).max() > 0.1  # the whitening is not a no-op here


def test_iso_c_flattens_the_summed_spectrum_worked_by_hand():
    base, states, q, r, base_np = _spectral_case([3.0, 1.0, 2.0, 2.0], [1.0, 1.0, 2.0, 0.0])
    # Σ τ = Q diag(4, 2, 4, 2) Rᵀ: mean singular value 3, so Iso-C = 3·Q Rᵀ
    merged = merge("iso_c", states, base=base, scaling=0.5)
    torch.testing.assert_close(merged["w"], _tensor(base_np + 0.5 * 3 * q @ r.T))
    torch.testing.assert_close(merged["b"], torch.tensor([0.25, 0.5], dtype=torch.float64))


def test_iso_cts_adds_each_tasks_own_direction_worked_by_hand():
    base, states, q, r, base_np = _spectral_case([4.0, 2.0, 3.0, 0.5], [4.0, 2.0, 0.5, 3.0])
    # fraction ½ of rank 4: common = top 2 of Σ τ = diag(8, 4, 3.5, 3.5) (q1, q2); with them projected out,
    # task 1's top direction is q3 (3), task 2's q4 (3); all four are orthonormal; σ̄ = (3+3+8+4)/4 = 4.5
    merged = merge("iso_cts", states, base=base, scaling=2.0, common_space_fraction=0.5)["w"]
    torch.testing.assert_close(merged, _tensor(base_np + 2.0 * 4.5 * q @ r.T))
    iso_c = merge("iso_c", states, base=base, scaling=2.0)["w"]  # Iso-C: σ̄ = (8+4+3.5+3.5)/4 = 4.75
    torch.testing.assert_close(iso_c, _tensor(base_np + 2.0 * 4.75 * q @ r.T))


def test_iso_cts_subspace_sizes_follow_fusionbench_and_never_go_negative():
    assert subspace_sizes(4, 2, 0.8) == (4, 0)  # ⌊3.2⌋ = 3, round(½) = 0 (half to even): all common
    assert subspace_sizes(10, 3, 0.8) == (7, 1)
    assert subspace_sizes(768, 8, 0.8) == (616, 19)
    assert subspace_sizes(10, 6, 0.0) == (4, 1)  # round(10/6) = 2 would need 12 > 10 directions


def test_iso_cts_of_one_model_is_refused():
    base, states, *_ = _spectral_case([1.0, 1.0, 1.0, 1.0])
    with pytest.raises(MergeflowError, match="iso_cts merges at least 2 models"):
        merge("iso_cts", states, base=base)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["merge.methods=[iso_cts]", "partition.num_clients=1"], "'iso_cts' (iso_cts) merges at least 2 models"),
        (["merge.options.tsv.rank_fraction=0"], "merge.options.tsv.rank_fraction"),
        (["merge.options.tsv.scaling=[0.5, -1]"], "merge.options.tsv.scaling"),
        (["merge.options.iso_cts.common_space_fraction=1.5"], "merge.options.iso_cts.common_space_fraction"),
        (["merge.options.karcher.max_iter=0"], "merge.options.karcher.max_iter"),
    ],
)
def test_bad_spectral_options_give_one_line_and_exit_2(tmp_path, monkeypatch, capsys, overrides, needle):
    make_workspace(tmp_path, pipeline_params())
    monkeypatch.chdir(tmp_path)
    assert main(["run", *[arg for o in overrides for arg in ("-S", o)]]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
