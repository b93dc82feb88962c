from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from mergeflow.errors import MergeflowError
from mergeflow.models.sequential import build_model
from mergeflow.training import (
    DivergenceError,
    TrainResult,
    make_optimizer,
    predict,
    train,
)


def _blobs(n: int = 200, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two linearly separable Gaussian blobs in 2-D."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    X = rng.normal(0.0, 0.5, (n, 2)) + np.where(y[:, None] == 1, 2.0, -2.0)
    return X.astype(np.float32), y


def _train_mlp(seed: int = 0) -> tuple[torch.nn.Module, TrainResult]:
    X, y = _blobs()
    model = build_model("mlp", [2], 2, widths=[16], seed=3)
    result = train(
        model, X, y, task="classification", epochs=5, lr=0.05, optimizer="sgd", momentum=0.9, batch_size=16, seed=seed
    )
    return model, result


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.1), ("adam", 0.01)])
def test_loss_decreases_on_separable_problem(optimizer: str, lr: float) -> None:
    X, y = _blobs()
    model = build_model("mlp", [2], 2, widths=[16], seed=0)
    result = train(model, X, y, task="classification", epochs=10, lr=lr, optimizer=optimizer, batch_size=32, seed=0)
    assert len(result.epoch_losses) == 10
    assert len(result.losses) == 10 * 7  # ceil(200 / 32) steps per epoch
    assert result.epoch_losses[-1] < 0.25 * result.epoch_losses[0]
    accuracy = (predict(model, X).argmax(axis=1) == y).mean()
    assert accuracy > 0.97


def test_same_seed_gives_bit_identical_weights() -> None:
    a, result_a = _train_mlp(seed=1)
    b, result_b = _train_mlp(seed=1)
    c, _ = _train_mlp(seed=2)
    assert result_a.losses == result_b.losses
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters(), strict=True))


def test_concurrent_threads_are_bit_identical_to_serial() -> None:
    reference, _ = _train_mlp(seed=1)
    models: dict[int, torch.nn.Module] = {}

    def worker(slot: int) -> None:
        torch.manual_seed(1000 + slot)  # perturbing the global RNG must not matter
        models[slot], _ = _train_mlp(seed=1)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for model in models.values():
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))


def test_regression_fits_linear_model() -> None:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(256, 3))
    w, b = np.array([1.5, -2.0, 0.5]), 0.3
    y = X @ w + b + rng.normal(0.0, 0.01, 256)
    model = build_model("linear", [3], 1, seed=0)
    result = train(model, X, y, task="regression", epochs=40, lr=0.05, batch_size=32)
    layer = model[1]
    np.testing.assert_allclose(layer.weight.detach().numpy()[0], w, atol=0.02)
    np.testing.assert_allclose(layer.bias.item(), b, atol=0.02)
    assert result.epoch_losses[-1] < 1e-3
    pred = predict(model, X)
    assert pred.dtype == np.float64 and pred.shape == (256, 1)
    assert 0.5 * np.mean((pred[:, 0] - y) ** 2) < 1e-3


def test_progress_bar_does_not_change_training() -> None:
    X, y = _blobs()
    runs = []
    for progress in (None, "client 0"):
        model = build_model("mlp", [2], 2, seed=0)
        runs.append(train(model, X, y, task="classification", epochs=2, lr=0.1, progress=progress).losses)
    assert runs[0] == runs[1]


def test_predict_restores_mode_and_matches_forward() -> None:
    X, _ = _blobs(n=50)
    model = build_model("mlp", [2], 3, seed=0)
    model.train()
    out = predict(model, X, batch_size=16)
    assert model.training
    expected = model(torch.as_tensor(X)).detach().double().numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)  # batching reorders sums


def test_unknown_optimizer_raises() -> None:
    model = build_model("linear", [2], 2)
    X, y = _blobs(n=8)
    with pytest.raises(ValueError, match="optimizer"):
        train(model, X, y, task="classification", epochs=1, lr=0.1, optimizer="rmsprop")
    with pytest.raises(ValueError, match="optimizer"):
        make_optimizer("lbfgs", model.parameters(), lr=0.1)


def test_unknown_task_raises() -> None:
    X, y = _blobs(n=8)
    with pytest.raises(MergeflowError, match="objective .ranking. is unknown"):
        train(build_model("linear", [2], 2), X, y, task="ranking", epochs=1, lr=0.1)


def test_nan_learning_rate_raises_divergence() -> None:
    X, y = _blobs()
    model = build_model("mlp", [2], 2, seed=0)
    with pytest.raises(DivergenceError, match=r"epoch 0, step 1"):
        train(model, X, y, task="classification", epochs=3, lr=float("nan"))
    assert issubclass(DivergenceError, RuntimeError)
