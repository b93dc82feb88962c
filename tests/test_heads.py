"""Task heads: which parameters a family calls the head, splitting and assembling states, a task's base and
head, and the body-only Fisher and RegMean merges of tasks with different label counts against closed forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from text_fixtures import tiny_transformer
from torch import nn

from mergeflow.fisher import diagonal_fisher
from mergeflow.grams import linear_input_grams
from mergeflow.heads import assemble, body_of, head_names, split_head, task_base, task_head
from mergeflow.merge.engine import run_merge
from mergeflow.models import family_of
from mergeflow.models.family import ModelFamily
from mergeflow.models.sequential import build_sequential_from_spec, model_spec
from mergeflow.models.sequential import head_names as sequential_head_names
from mergeflow.training import train


@pytest.mark.parametrize(
    "arch,options,expected",
    [
        ("linear", {}, ("1.weight", "1.bias")),
        ("mlp", {"widths": [8, 6]}, ("5.weight", "5.bias")),
        ("cnn", {"channels": [2], "cnn_hidden": 5}, ("6.weight", "6.bias")),
    ],
)
def test_a_sequential_head_is_the_last_linear_layer(arch, options, expected):
    spec = model_spec(arch, [1, 4, 4], 3, **options)
    assert head_names(spec) == expected
    model = build_sequential_from_spec(spec)
    assert set(expected) <= set(model.state_dict())
    assert tuple(model.state_dict()[key].shape[0] for key in expected) == (3, 3)


def test_a_sequence_classifiers_head_is_outside_the_base_model_under_the_wrappers_prefix():
    bert, bert_spec = tiny_transformer("bert", num_labels=3)
    assert head_names(bert_spec) == ("model.classifier.weight", "model.classifier.bias")
    gpt2, gpt2_spec = tiny_transformer("gpt2", num_labels=3)
    assert head_names(gpt2_spec) == ("model.score.weight",)
    for model, spec in ((bert, bert_spec), (gpt2, gpt2_spec)):
        state = model.state_dict()
        assert set(head_names(spec)) <= set(state)
        prefix = f"model.{model.model.base_model_prefix}."
        assert all(key.startswith(prefix) for key in state if key not in head_names(spec))


def test_a_causal_lm_has_no_head_and_keeps_its_spec_and_state():
    model, spec = tiny_transformer("gpt2", task="causal_lm", num_labels=1)
    assert head_names(spec) == ()
    state = model.state_dict()
    task_spec, task_state = task_base(spec, state, 7, seed=3)
    assert task_spec == spec
    assert task_state.keys() == state.keys() and all(task_state[k] is state[k] for k in state)


def test_with_outputs_gives_the_architecture_a_head_of_that_size():
    spec = model_spec("mlp", [5], 3, widths=[4], seed=1)
    assert family_of("mlp").with_outputs(spec, 6) == spec | {"output_dim": 6}
    assert family_of("mlp").with_outputs(spec, 6, seed=9) == spec | {"output_dim": 6, "seed": 9}
    _, bert_spec = tiny_transformer("bert", num_labels=3)
    wide = family_of("transformers").with_outputs(bert_spec, 5)
    assert wide["output_dim"] == 5 and len(wide["hf_config"]["id2label"]) == 5
    assert family_of("transformers").from_spec(wide).state_dict()["model.classifier.weight"].shape[0] == 5


def test_a_family_without_heads_says_so():
    class Headless(ModelFamily):
        def build_base(self, model, info, output_dim, seed):
            raise NotImplementedError

        def from_spec(self, spec):
            raise NotImplementedError

    family = Headless(family_of("mlp").declaration)
    with pytest.raises(TypeError, match="declares no task head"):
        family.head_names({})
    with pytest.raises(TypeError, match="declares no task head"):
        family.with_outputs({}, 2)


def test_split_and_assemble_round_trip_the_same_tensors():
    state = build_sequential_from_spec(model_spec("mlp", [5], 3, widths=[4])).state_dict()
    body, head = split_head(state, ("3.weight", "3.bias"))
    assert set(head) == {"3.weight", "3.bias"} and set(body) == {"1.weight", "1.bias"}
    whole = assemble(body, head)
    assert whole.keys() == state.keys() and all(whole[k] is state[k] for k in state)
    with pytest.raises(KeyError, match="9.weight"):
        split_head(state, ("9.weight",))
    with pytest.raises(ValueError, match="3.weight"):
        assemble(state, head)


def test_a_task_head_of_one_client_is_its_head_bit_for_bit_of_several_their_weighted_mean():
    rng = np.random.default_rng(0)
    heads = [{"w": torch.tensor(rng.normal(size=(3, 4)), dtype=torch.float32)} for _ in range(3)]
    one = task_head(heads[:1], [17])
    assert one["w"] is heads[0]["w"]
    mean = task_head(heads, [1, 2, 5])
    expected = sum(w * h["w"].double() for w, h in zip([1, 2, 5], heads, strict=True)) / 8
    assert mean["w"].dtype == torch.float32
    assert torch.equal(mean["w"], expected.float())
    with pytest.raises(ValueError, match="'w'"):
        task_head([heads[0], {"w": torch.zeros(2, 4)}], [1, 1])
    with pytest.raises(ValueError, match="one weight per head"):
        task_head(heads, [1, 2])


@pytest.mark.parametrize("which", ["mlp", "bert"])
def test_a_task_base_keeps_the_body_bit_for_bit_with_a_new_deterministic_head(which):
    if which == "mlp":
        spec = model_spec("mlp", [5], 3, widths=[4], seed=1)
        state = build_sequential_from_spec(spec).state_dict()
    else:
        model, spec = tiny_transformer("bert", num_labels=3)
        state = model.state_dict()
    names = head_names(spec)
    task_spec, task_state = task_base(spec, state, 6, seed=11)
    again_spec, again = task_base(spec, state, 6, seed=11)
    other_spec, other = task_base(spec, state, 6, seed=12)
    assert task_spec == again_spec and task_spec["output_dim"] == 6
    assert list(task_state) == list(family_of(spec["arch"]).from_spec(task_spec).state_dict())
    for key, value in state.items():
        if key not in names:
            assert task_state[key] is value
    for key in names:
        assert task_state[key].shape[0] == 6
        assert torch.equal(task_state[key], again[key])
    assert not all(torch.equal(task_state[key], other[key]) for key in names)
    family_of(spec["arch"]).from_spec(task_spec).load_state_dict(task_state)  # the task's spec fits its state


def test_a_task_base_names_a_state_that_is_not_the_specs():
    spec = model_spec("mlp", [5], 3, widths=[4])
    state = build_sequential_from_spec(model_spec("mlp", [6], 3, widths=[4])).state_dict()
    with pytest.raises(ValueError, match="1.weight"):
        task_base(spec, state, 2, seed=0)
    state = build_sequential_from_spec(spec).state_dict()
    with pytest.raises(KeyError, match="1.bias"):
        task_base(spec, {k: v for k, v in state.items() if k != "1.bias"}, 2, seed=0)


# Fisher and RegMean of tasks with different label counts, body only, against closed forms.

CLASSES = (3, 2, 5)
SIZES = (40, 60, 50)
D, H = 4, 3


def _task_data(k: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + k)
    X = rng.normal(size=(SIZES[k], D)).astype(np.float32)
    teacher = rng.normal(size=(CLASSES[k], D))
    y = np.argmax(X @ teacher.T + 0.3 * rng.normal(size=(SIZES[k], CLASSES[k])), axis=1)
    return X, y


def _linear_body_client(k: int, body: nn.Sequential) -> nn.Sequential:
    """Two activation-free Linear layers (the shared body) and task k's own head Linear(H, C_k)."""
    head = nn.Linear(H, CLASSES[k])
    generator = torch.Generator().manual_seed(k)
    with torch.no_grad():
        head.weight.copy_(torch.rand(head.weight.shape, generator=generator) - 0.5)
        head.bias.copy_(torch.rand(head.bias.shape, generator=generator) - 0.5)
    model = nn.Sequential(nn.Linear(D, H), nn.Linear(H, H), head)
    model.load_state_dict(body.state_dict(), strict=False)
    return model


def _clients(kind: str) -> tuple[list[nn.Module], tuple[str, ...], list[tuple[np.ndarray, np.ndarray]]]:
    """Each task's model from one shared body with its own head, trained briefly on its own data, in float64."""
    data = [_task_data(k) for k in range(len(CLASSES))]
    if kind == "linear":
        torch.manual_seed(0)
        body = nn.Sequential(nn.Linear(D, H), nn.Linear(H, H))
        models = [_linear_body_client(k, body) for k in range(len(CLASSES))]
        names = sequential_head_names(models[0])
    else:  # the mlp family (tanh), each task's base made by task_base from one base state
        spec = model_spec("mlp", [D], 4, widths=[H, H], activation="tanh", seed=0)
        base = build_sequential_from_spec(spec).state_dict()
        models = []
        for k, classes in enumerate(CLASSES):
            task_spec, state = task_base(spec, base, classes, seed=k)
            model = build_sequential_from_spec(task_spec)
            model.load_state_dict(state)
            models.append(model)
        names = head_names(spec)
    for k, (model, (X, y)) in enumerate(zip(models, data, strict=True)):
        train(model, X, y, task="classification", epochs=4, lr=0.2, batch_size=16, seed=k)
    return [model.double() for model in models], names, data


@pytest.fixture(scope="module", params=["linear", "mlp"])
def clients(request):
    return request.param, *_clients(request.param)


def _layers(model: nn.Module) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(module name, W, b) of every Linear layer in order, float64 numpy."""
    return [
        (name, m.weight.detach().numpy().astype(np.float64), m.bias.detach().numpy().astype(np.float64))
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]


def _activation(kind: str):
    """The activation between layers and its derivative at the pre-activation."""
    if kind == "linear":
        return (lambda a: a), (lambda a: np.ones_like(a))
    return np.tanh, (lambda a: 1 - np.tanh(a) ** 2)


def _forward(layers, X: np.ndarray, kind: str) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Each layer's inputs (rows), the body layers' pre-activations, and the softmax probabilities."""
    act, _ = _activation(kind)
    inputs, pre, h = [], [], X.astype(np.float64)
    for _, W, b in layers[:-1]:
        inputs.append(h)
        a = h @ W.T + b
        pre.append(a)
        h = act(a)
    inputs.append(h)
    _, W, b = layers[-1]
    z = h @ W.T + b
    p = np.exp(z - z.max(1, keepdims=True))
    return inputs, pre, p / p.sum(1, keepdims=True)


def _closed_form_fisher(
    model: nn.Module, X: np.ndarray, kind: str, y: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """F = E_x Σ_c p_c g_c² (``y`` None: the exact Fisher) or E_x g_y² (the empirical one, with the labels ``y``),
    g_c = ∂ log p_c/∂θ by backpropagation written out by hand."""
    _, derivative = _activation(kind)
    layers = _layers(model)
    inputs, pre, p = _forward(layers, X, kind)
    weights = p if y is None else np.eye(p.shape[1])[y]
    fisher = {f"{name}.{part}": 0.0 for name, *_ in layers for part in ("weight", "bias")}
    for c in range(p.shape[1]):
        delta = np.eye(p.shape[1])[c][None] - p  # ∂ log p_c / ∂ logits, per example
        for i in range(len(layers) - 1, -1, -1):
            name, W, _ = layers[i]
            weight_grad = delta[:, :, None] * inputs[i][:, None, :]
            fisher[f"{name}.weight"] = fisher[f"{name}.weight"] + (weights[:, c, None, None] * weight_grad**2).sum(0)
            fisher[f"{name}.bias"] = fisher[f"{name}.bias"] + (weights[:, c, None] * delta**2).sum(0)
            if i:
                delta = (delta @ W) * derivative(pre[i - 1])
    return {key: value / len(X) for key, value in fisher.items()}


@pytest.mark.parametrize("backend", ["backpack", "functorch"])
@pytest.mark.parametrize("fisher_kind", ["exact", "empirical"])
def test_each_clients_fisher_with_its_own_head_and_labels_is_the_closed_form(clients, fisher_kind, backend):
    kind, models, _, data = clients
    for model, (X, y) in zip(models, data, strict=True):
        fisher = diagonal_fisher(model, X, y, kind=fisher_kind, task="classification", backend=backend)
        expected = _closed_form_fisher(model, X, kind, y if fisher_kind == "empirical" else None)
        assert fisher.keys() == expected.keys()
        for key, value in fisher.items():
            np.testing.assert_allclose(value.numpy(), expected[key], rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("options", [{}, {"normalize": True}, {"by_size": False, "floor": 0.0}])
def test_fisher_merge_of_tasks_with_their_own_heads_equals_the_closed_form(clients, options):
    kind, models, names, data = clients
    fishers = []
    for model, (X, y) in zip(models, data, strict=True):
        fisher = diagonal_fisher(model, X, y, kind="exact", task="classification")
        fishers.append(body_of(fisher, names))
    states = [model.state_dict() for model in models]
    bodies = [body_of(state, names) for state in states]
    result = run_merge("fisher", bodies, fishers=fishers, weights=list(SIZES), **options)
    assert result.state.keys() == bodies[0].keys() and not set(names) & set(result.state)

    # θ* = Σ_k λ_k F_k θ_k / Σ_k λ_k F_k elementwise, from the closed-form Fishers: F_k floored at ``floor``,
    # λ_k = n_k/N with ``by_size``, divided by the L2 norm of F_k (over the merged keys) with ``normalize``.
    closed = [body_of(_closed_form_fisher(model, X, kind), names) for model, (X, _) in zip(models, data, strict=True)]
    floor = options.get("floor", 1e-8)
    lam = np.array(SIZES, dtype=np.float64) / sum(SIZES) if options.get("by_size", True) else np.ones(len(SIZES))
    if options.get("normalize"):
        lam = lam / np.array([np.sqrt(sum((f**2).sum() for f in fisher.values())) for fisher in closed])
    for key in bodies[0]:
        precision = [lam[k] * np.maximum(closed[k][key], floor) for k in range(len(models))]
        merged = sum(f * b[key].numpy() for f, b in zip(precision, bodies, strict=True)) / sum(precision)
        np.testing.assert_allclose(result.state[key].numpy(), merged, rtol=1e-9, atol=1e-13)
    _each_task_keeps_its_own_head(result.state, states, names)


@pytest.mark.parametrize("alpha", [1.0, 0.7])
def test_regmean_of_tasks_with_their_own_heads_equals_the_closed_form(clients, alpha):
    kind, models, names, data = clients
    grams = []
    for model, (X, _) in zip(models, data, strict=True):
        gram = linear_input_grams(model, X)
        layers = _layers(model)
        inputs, _, _ = _forward(layers, X, kind)
        assert gram.keys() == {f"{name}.weight" for name, *_ in layers}  # the head's too: the merge leaves it out
        for (name, *_), rows in zip(layers, inputs, strict=True):
            np.testing.assert_allclose(gram[f"{name}.weight"].numpy(), rows.T @ rows, rtol=1e-12)
        grams.append(body_of(gram, names))
    states = [model.state_dict() for model in models]
    bodies = [body_of(state, names) for state in states]
    result = run_merge("regmean", bodies, grams=grams, alpha=alpha)
    assert result.state.keys() == bodies[0].keys() and not set(names) & set(result.state)

    for key in grams[0]:
        shrunk = [alpha * g[key].numpy() + (1 - alpha) * np.diag(np.diag(g[key].numpy())) for g in grams]
        weights = [b[key].numpy() for b in bodies]
        # W* = (Σ_k W_k G_k)(Σ_k G_k)⁻¹, i.e. (Σ G_k) W*ᵀ = Σ G_k W_kᵀ
        expected = np.linalg.solve(sum(shrunk), sum(g @ w.T for g, w in zip(shrunk, weights, strict=True))).T
        np.testing.assert_allclose(result.state[key].numpy(), expected, rtol=1e-9, atol=1e-12)
        bias = key.removesuffix("weight") + "bias"
        np.testing.assert_allclose(result.state[bias].numpy(), np.mean([b[bias].numpy() for b in bodies], axis=0))
    _each_task_keeps_its_own_head(result.state, states, names)


def _each_task_keeps_its_own_head(merged_body, states, names) -> None:
    for k, state in enumerate(states):
        head = task_head([split_head(state, names)[1]], [SIZES[k]])
        model = assemble(merged_body, head)
        assert model.keys() == state.keys()
        assert all(torch.equal(model[key], state[key]) for key in names)
        assert model[names[0]].shape[0] == CLASSES[k]
