"""Fisher estimates against closed forms: linear regression and softmax regression."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergeflow.fisher import diagonal_fisher, fisher_factors, flatten_parameters
from mergeflow.models.sequential import build_model


def _data(n=64, d=5, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.integers(0, classes, size=n)
    return X, y


def _augmented(X):
    return np.concatenate([X, np.ones((len(X), 1), np.float32)], axis=1).astype(np.float64)


def _softmax_scores(model, X):
    """Per-example, per-class scores ∇ log p_c over (W flattened row-major, b)."""
    with torch.no_grad():
        p = torch.softmax(model(torch.as_tensor(X)), dim=1).double().numpy()
    n, classes = p.shape
    Xa = _augmented(X)
    d = X.shape[1]
    scores = np.zeros((n, classes, classes * d + classes))
    for c in range(classes):
        residual = np.eye(classes)[c][None] - p  # (n, C): ∂ log p_c / ∂ logits
        scores[:, c, : classes * d] = (residual[:, :, None] * Xa[:, None, :d]).reshape(n, -1)
        scores[:, c, classes * d :] = residual
    return p, scores


@pytest.mark.parametrize("backend", ["backpack", "functorch"])
def test_linear_regression_fisher_is_xtx_over_sigma2(backend):
    X, _ = _data()
    y = np.random.default_rng(1).normal(size=len(X)).astype(np.float32)
    model = build_model("linear", [5], 1, seed=0)
    sigma = 0.5
    expected = _augmented(X).T @ _augmented(X) / (len(X) * sigma**2)
    U = fisher_factors(model, X, y, kind="exact", task="regression", noise_std=sigma, backend=backend, batch_size=20)
    np.testing.assert_allclose((U.T @ U).double().numpy(), expected, rtol=1e-5, atol=1e-6)
    diag = diagonal_fisher(model, X, y, kind="exact", task="regression", noise_std=sigma, backend=backend)
    flat = flatten_parameters(diag, model).double().numpy()
    np.testing.assert_allclose(flat, np.diag(expected), rtol=1e-5)


@pytest.mark.parametrize("backend", ["backpack", "functorch"])
def test_softmax_regression_exact_fisher_closed_form(backend):
    X, y = _data()
    model = build_model("linear", [5], 3, seed=0)
    p, scores = _softmax_scores(model, X)
    # Σ_n (diag(p) − ppᵀ) ⊗ x xᵀ, written as the expectation over classes of score outer products.
    expected = np.einsum("nc,nci,ncj->ij", p, scores, scores) / len(X)
    U = fisher_factors(model, X, y, kind="exact", backend=backend, batch_size=24)
    np.testing.assert_allclose((U.T @ U).double().numpy(), expected, rtol=1e-4, atol=1e-6)
    diag = flatten_parameters(diagonal_fisher(model, X, y, kind="exact", backend=backend), model)
    np.testing.assert_allclose(diag.double().numpy(), np.diag(expected), rtol=1e-4, atol=1e-7)


def test_softmax_regression_empirical_fisher_uses_data_labels():
    X, y = _data()
    model = build_model("linear", [5], 3, seed=0)
    _, scores = _softmax_scores(model, X)
    chosen = scores[np.arange(len(y)), y]
    expected = chosen.T @ chosen / len(X)
    for backend in ("backpack", "functorch"):
        U = fisher_factors(model, X, y, kind="empirical", backend=backend)
        np.testing.assert_allclose((U.T @ U).double().numpy(), expected, rtol=1e-4, atol=1e-6)
        diag = flatten_parameters(diagonal_fisher(model, X, y, kind="empirical", backend=backend), model)
        np.testing.assert_allclose(diag.double().numpy(), np.diag(expected), rtol=1e-4, atol=1e-7)


def test_per_example_not_batch_gradient_squared():
    X, y = _data()
    model = build_model("linear", [5], 3, seed=0)
    per_example = flatten_parameters(diagonal_fisher(model, X, y, kind="empirical", batch_size=64), model)
    _, scores = _softmax_scores(model, X)
    batch_gradient_squared = scores[np.arange(len(y)), y].sum(0) ** 2 / len(X)
    assert not np.allclose(per_example.numpy(), batch_gradient_squared, rtol=1e-2)


@pytest.mark.parametrize("kind", ["empirical", "sampled", "exact"])
def test_backends_agree_on_an_mlp_and_batch_size_does_not_matter(kind):
    X, y = _data(n=48, d=6, classes=4)
    model = build_model("mlp", [6], 4, widths=[8, 7], activation="tanh", seed=3)
    a = diagonal_fisher(model, X, y, kind=kind, backend="backpack", batch_size=48, seed=5)
    b = diagonal_fisher(model, X, y, kind=kind, backend="functorch", batch_size=48, seed=5)
    c = diagonal_fisher(model, X, y, kind=kind, backend="backpack", batch_size=7, seed=5)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-7)
        if kind != "sampled":  # sampled labels are drawn per batch
            torch.testing.assert_close(a[name], c[name], rtol=1e-4, atol=1e-7)
    Ua = fisher_factors(model, X, y, kind=kind, backend="backpack", seed=5)
    Ub = fisher_factors(model, X, y, kind=kind, backend="functorch", seed=5)
    torch.testing.assert_close(Ua.T @ Ua, Ub.T @ Ub, rtol=1e-4, atol=1e-6)
    flat = flatten_parameters(a, model)
    torch.testing.assert_close(torch.diagonal(Ua.T @ Ua), flat, rtol=1e-4, atol=1e-7)


def test_sampled_fisher_is_deterministic_for_a_seed_and_close_to_exact():
    X, y = _data(n=2000, d=4, classes=3, seed=2)
    model = build_model("linear", [4], 3, seed=1)
    one = diagonal_fisher(model, X, y, kind="sampled", seed=11)
    two = diagonal_fisher(model, X, y, kind="sampled", seed=11)
    exact = diagonal_fisher(model, X, y, kind="exact")
    for name in one:
        assert torch.equal(one[name], two[name])
        torch.testing.assert_close(one[name], exact[name], rtol=0.15, atol=1e-3)


def test_cnn_runs_through_backpack():
    rng = np.random.default_rng(0)
    X = rng.random((10, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, size=10)
    model = build_model("cnn", [1, 8, 8], 10, seed=0)
    a = diagonal_fisher(model, X, y, kind="exact", backend="backpack")
    b = diagonal_fisher(model, X, y, kind="exact", backend="functorch")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-8)


def test_unknown_kind_is_refused():
    X, y = _data()
    with pytest.raises(ValueError, match="fisher kind"):
        diagonal_fisher(build_model("linear", [5], 3), X, y, kind="fancy")


def test_frequent_directions_bounds_its_error_by_the_shrinkage_it_reports():
    from mergeflow.sketch import FrequentDirections

    generator = torch.Generator().manual_seed(0)
    A = torch.randn(300, 40, generator=generator, dtype=torch.float64) @ torch.diag(
        torch.logspace(0, -3, 40, dtype=torch.float64)
    )
    exact = FrequentDirections(300, 40, dtype=torch.float64)
    exact.insert(A)
    torch.testing.assert_close(exact.sketch().T @ exact.sketch(), A.T @ A)  # room for every row: no error
    assert exact.shrinkage == 0
    for rows in (5, 10, 20):
        sketch = FrequentDirections(rows, 40, dtype=torch.float64)
        for block in A.split(17):
            sketch.insert(block)
        B = sketch.sketch()
        error = torch.linalg.eigvalsh(A.T @ A - B.T @ B)
        assert len(B) <= rows and sketch.seen == 300
        assert float(error.min()) > -1e-9  # BᵀB never overstates AᵀA
        assert float(error.max()) <= sketch.shrinkage + 1e-9 <= float((A**2).sum()) / (rows + 1) + 1e-9


def test_a_fisher_sketch_within_a_budget_sees_every_example_and_beats_a_subset_of_the_same_rows():
    from mergeflow.fisher import factor_rows_within, fisher_sketch

    model = build_model("mlp", [8], 3, widths=[16], seed=0)
    generator = torch.Generator().manual_seed(1)
    X = torch.randn(400, 8, generator=generator)
    y = torch.randint(0, 3, (400,), generator=generator)
    options = {"kind": "empirical", "backend": "functorch", "batch_size": 64}
    full = fisher_factors(model, X, y, **options)  # all 400 examples: F = UᵀU
    F = full.T.double() @ full.double()
    whole, facts = fisher_sketch(model, X, y, rows=400, **options)
    torch.testing.assert_close(whole.T.double() @ whole.double(), F, rtol=1e-5, atol=1e-7)
    assert facts["shrinkage"] == 0 and facts["examples"] == 400
    dim = sum(p.numel() for p in model.parameters())
    rows = factor_rows_within(12 * dim * 20, dim)
    assert rows == 20
    sketched, facts = fisher_sketch(model, X, y, rows=rows, **options)
    assert sketched.shape == (20, dim) and facts["trace"] == pytest.approx(float(torch.trace(F)), rel=1e-5)
    sketch_error = torch.linalg.matrix_norm(F - sketched.T.double() @ sketched.double(), ord=2)
    assert sketch_error <= facts["shrinkage"] * (1 + 1e-6)
    subset = fisher_factors(model, X[:20], y[:20], **options)  # the per-example factors of 20 examples
    subset_error = torch.linalg.matrix_norm(F - subset.T.double() @ subset.double(), ord=2)
    assert sketch_error < 0.5 * subset_error
