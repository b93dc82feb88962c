"""Joint multi-task training: one body shared by K task models with their own heads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from text_fixtures import tiny_transformer

from mergeflow.heads import head_names, task_base
from mergeflow.models import build_from_spec
from mergeflow.models.sequential import build_sequential_from_spec, model_spec
from mergeflow.multitask import tie_bodies, train_jointly
from mergeflow.training import minibatches, predict, round_robin, train

SPEC = model_spec("mlp", [2], 4, widths=[16], seed=0)
HEADS = head_names(SPEC)


def _task_models(classes: dict[str, int], base_seed: int = 0) -> dict[str, torch.nn.Module]:
    """One model per task from one base state, each with its own seeded head (task_base)."""
    base = build_sequential_from_spec(SPEC | {"seed": base_seed}).state_dict()
    models = {}
    for k, (name, count) in enumerate(classes.items()):
        spec, state = task_base(SPEC, base, count, seed=10 + k)
        models[name] = build_sequential_from_spec(spec)
        models[name].load_state_dict(state)
    return models


def _blobs(n: int, centres: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, len(centres), n)
    return (centres[y] + rng.normal(0.0, 0.4, (n, 2))).astype(np.float32), y


def _two_tasks() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Quadrant (4 classes, 120 rows) and half-plane (2 classes, 70 rows) tasks on 2-D points."""
    quadrants = np.array([[2.0, 2.0], [-2.0, 2.0], [-2.0, -2.0], [2.0, -2.0]])
    X, y = _blobs(120, quadrants, 1)
    X2, _ = _blobs(70, quadrants, 2)
    return {"quadrant": (X, y), "side": (X2, (X2[:, 0] > 0).astype(np.int64))}


def _joint(seed: int = 0, **options):
    models = _task_models({"quadrant": 4, "side": 2})
    settings = {"task": "classification", "epochs": 6, "lr": 0.1, "batch_size": 16, "seed": seed} | options
    result = train_jointly(models, _two_tasks(), heads=HEADS, **settings)
    return models, result


def test_the_tasks_share_one_body_and_keep_their_own_heads():
    models, _ = _joint(epochs=1)
    quadrant, side = models["quadrant"], models["side"]
    for name, parameter in quadrant.named_parameters():
        other = dict(side.named_parameters())[name]
        assert (other is parameter) == (name not in HEADS)
    unique = {id(p) for model in models.values() for p in model.parameters()}
    assert len(unique) == len(list(quadrant.parameters())) + len(HEADS)
    assert dict(side.named_parameters())[HEADS[0]].shape[0] == 2


def test_a_heads_gradient_comes_only_from_its_own_tasks_batches():
    models = _task_models({"quadrant": 4, "side": 2})
    tie_bodies(list(models.values()), HEADS)
    X, y = _two_tasks()["quadrant"]
    loss = torch.nn.functional.cross_entropy(models["quadrant"](torch.as_tensor(X)), torch.as_tensor(y))
    loss.backward()
    side = dict(models["side"].named_parameters())
    assert all(side[name].grad is None for name in HEADS)
    assert all(side[name].grad is not None and side[name].grad.abs().sum() > 0 for name in side if name not in HEADS)


def test_joint_training_is_the_round_robin_protocol_step_by_step():
    """Plain SGD written out: each epoch's batches drawn task by task from one generator, taken round-robin;
    a step moves the body and its own task's head by its own task's loss gradient."""
    data = _two_tasks()
    models, result = _joint(epochs=3, batch_size=32)
    reference = _task_models({"quadrant": 4, "side": 2})
    body = {n: p.detach().clone() for n, p in reference["quadrant"].named_parameters() if n not in HEADS}
    heads = {t: {n: dict(m.named_parameters())[n].detach().clone() for n in HEADS} for t, m in reference.items()}
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        epoch = [list(minibatches(len(data[t][0]), 32, generator)) for t in data]
        for k, idx in round_robin(epoch):
            name = list(data)[k]
            X, y = data[name]
            params = {n: v.requires_grad_(True) for n, v in (body | heads[name]).items()}
            outputs = torch.func.functional_call(reference[name], params, (torch.as_tensor(X[idx]),))
            grads = torch.autograd.grad(
                torch.nn.functional.cross_entropy(outputs, torch.as_tensor(y[idx])), list(params.values())
            )
            with torch.no_grad():
                for (n, value), g in zip(params.items(), grads, strict=True):
                    (body if n not in HEADS else heads[name])[n] = (value - 0.1 * g).detach()
    assert len(result.losses) == 3 * (4 + 3)  # 120 rows: 4 batches of 32, 70 rows: 3
    for name, model in models.items():
        for n, parameter in model.named_parameters():
            expected = heads[name][n] if n in HEADS else body[n]
            torch.testing.assert_close(parameter.detach(), expected, rtol=1e-6, atol=1e-7)


def test_joint_training_is_deterministic_and_one_task_is_train():
    a, result_a = _joint(seed=3, momentum=0.9, weight_decay=1e-3)
    b, result_b = _joint(seed=3, momentum=0.9, weight_decay=1e-3)
    assert result_a.losses == result_b.losses and result_a.part_epoch_losses == result_b.part_epoch_losses
    for name in a:
        assert all(torch.equal(p, q) for p, q in zip(a[name].parameters(), b[name].parameters(), strict=True))

    X, y = _two_tasks()["quadrant"]
    alone = _task_models({"quadrant": 4})["quadrant"]
    joint = _task_models({"quadrant": 4})
    options = {"task": "classification", "epochs": 2, "lr": 0.1, "optimizer": "adam", "batch_size": 16, "seed": 5}
    trained = train(alone, X, y, **options)
    jointly = train_jointly(joint, {"quadrant": (X, y)}, heads=HEADS, **options)
    assert trained.losses == jointly.losses and trained.epoch_losses == jointly.epoch_losses
    assert all(torch.equal(p, q) for p, q in zip(alone.parameters(), joint["quadrant"].parameters(), strict=True))


def test_joint_training_learns_both_tasks_well_above_chance():
    models, result = _joint(epochs=15, momentum=0.9)
    data = _two_tasks()
    for name, model in models.items():
        X, y = data[name]
        accuracy = (predict(model, X).argmax(axis=1) == y).mean()
        assert accuracy > 0.9, (name, accuracy)
    assert [len(losses) for losses in result.part_epoch_losses] == [15, 15]
    assert all(losses[-1] < 0.5 * losses[0] for losses in result.part_epoch_losses)


def test_models_that_do_not_start_from_one_body_are_refused():
    models = _task_models({"quadrant": 4}) | {"side": _task_models({"side": 2}, base_seed=1)["side"]}
    with pytest.raises(ValueError, match="body parameter '1.weight'"):
        tie_bodies(list(models.values()), HEADS)
    with pytest.raises(ValueError, match="no head parameter '9.weight'"):
        tie_bodies(list(models.values()), ("9.weight",))
    with pytest.raises(ValueError, match="are not the data's"):
        train_jointly(
            models, {"quadrant": _two_tasks()["quadrant"]}, heads=HEADS, task="classification", epochs=1, lr=0.1
        )


def test_tying_causal_lms_shares_every_weight_and_keeps_the_output_layer_tied():
    first, _ = tiny_transformer("gpt2", task="causal_lm", num_labels=1, seed=0)
    second, _ = tiny_transformer("gpt2", task="causal_lm", num_labels=1, seed=0)
    tie_bodies([first, second], ())
    assert second.model.lm_head.weight is first.model.transformer.wte.weight
    assert all(p is q for p, q in zip(first.parameters(), second.parameters(), strict=True))


def test_transformer_tasks_train_jointly_with_their_own_classifiers():
    model, spec = tiny_transformer("bert", num_labels=2)
    names = head_names(spec)
    models = {}
    for k, classes in enumerate((2, 3)):
        task_spec, state = task_base(spec, model.state_dict(), classes, seed=k)
        models[f"t{k}"] = build_from_spec(task_spec)
        models[f"t{k}"].load_state_dict(state)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 300, size=(24, 10))
    ids[::2, 6:] = 0
    data = {"t0": (ids, rng.integers(0, 2, 24)), "t1": (ids[:16], rng.integers(0, 3, 16))}
    result = train_jointly(models, data, heads=names, task="classification", epochs=1, lr=1e-3, optimizer="adam")
    assert len(result.losses) == 2  # batches of 32: one per task
    assert (
        models["t1"].model.bert.embeddings.word_embeddings.weight
        is models["t0"].model.bert.embeddings.word_embeddings.weight
    )
    assert models["t1"].state_dict()["model.classifier.weight"].shape[0] == 3
