"""A model family and an objective are each one declaration plus one implementation class: params validate,
stages build and train through them, and nothing else changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from mergeflow.config import validate_params
from mergeflow.errors import ConfigError
from mergeflow.evaluation import best_model, evaluate_outputs
from mergeflow.models import ModelFamily, build_from_spec
from mergeflow.objectives import Baseline, Objective
from mergeflow.schema import families, objectives
from mergeflow.training import predict, train


class Bilinear(ModelFamily):
    """A product of two linear maps, as a family's own module would define it."""

    def build_base(self, model, info, output_dim, seed):
        spec = {"arch": "bilinear", "inputs": int(np.prod(info["input_shape"])), "outputs": output_dim, "seed": seed}
        return self.from_spec(spec), spec

    def from_spec(self, spec):
        generator = torch.Generator().manual_seed(spec["seed"])
        model = nn.Sequential(nn.Flatten(), nn.Linear(spec["inputs"], 3), nn.Linear(3, spec["outputs"]))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
        return model


class Absolute(Objective):
    """Regression with a Laplace likelihood (mean absolute error)."""

    def targets(self, y, inputs, model):
        return torch.as_tensor(y).to(torch.float32).reshape(-1)

    def loss(self, outputs, targets):
        return (outputs[:, 0] - targets).abs().mean()

    def metrics(self, outputs, y, *, n_bins, noise_std):
        error = np.abs(np.asarray(outputs)[:, 0] - y)
        return {"mae": float(error.mean()), "nll": float((np.log(2 * noise_std) + error / noise_std).mean())}

    def ensemble(self, outputs_list):
        return np.median(np.stack(outputs_list), axis=0)

    def baseline(self, y_train, y_test, predictions):
        scores = -np.abs(y_test - np.median(y_train))
        return Baseline(scores, {"baseline": "training median"}, "the training median", lambda s: f"{-s:.3g}")

    def row_scores(self, predicted, y_test):
        return -np.abs(np.asarray(predicted).reshape(len(y_test), -1)[:, 0] - y_test)


@pytest.fixture()
def bilinear():
    """A family declared here, its implementation the class above (a notebook's or a module's own)."""

    @families.declare_family
    class BilinearDeclaration(families.FamilyDeclaration):
        name = "bilinear"
        archs = ("bilinear",)
        implementation = f"{__name__}:Bilinear"
        inputs = "features"
        backpack = True
        language_models = False
        flavour = "pyfunc"

    yield BilinearDeclaration
    families.DECLARED.pop("bilinear")


@pytest.fixture()
def absolute():
    """An objective declared here, its implementation the class above."""
    declaration = objectives.ObjectiveDeclaration(
        "absolute", rank_by="mae", headline="mae", select_by=("nll",),
        implementation=f"{__name__}:Absolute",
    )  # fmt: skip
    yield objectives.DECLARED.declare(declaration)
    objectives.DECLARED.pop("absolute")


def test_a_new_model_family_is_one_declaration(bilinear):
    from tasks.training import _base_model

    params = validate_params({"model": {"arch": "bilinear"}, "align": {"method": "none"}})
    assert params.model.family.name == "bilinear" and params.objective == "classification"
    model, spec = _base_model(
        params.section("model"), {"input_shape": [4], "num_classes": 3, "task": "classification"}, 7
    )
    rebuilt = build_from_spec(spec)  # what every later step does with a checkpoint's spec
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), rebuilt.state_dict().values(), strict=True)
    )
    assert model(torch.ones(2, 4)).shape == (2, 3)
    with pytest.raises(ConfigError, match="align.method: permutation alignment of bilinear models is not implemented"):
        validate_params({"model": {"arch": "bilinear"}, "align": {"method": "weights"}})
    with pytest.raises(
        ConfigError, match="model.arch: 'resnet' is unknown; known: linear, mlp, cnn, transformers, bilinear"
    ):
        validate_params({"model": {"arch": "resnet"}})


def test_a_new_objective_is_one_declaration(absolute):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((256, 3)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5]) + 0.05 * rng.laplace(size=256)).astype(np.float32)
    model = nn.Linear(3, 1)
    before = evaluate_outputs(predict(model, X, task="absolute"), y, task="absolute", noise_std=0.1)
    train(model, X, y, task="absolute", epochs=60, lr=0.05, batch_size=32)
    after = evaluate_outputs(predict(model, X, task="absolute"), y, task="absolute", noise_std=0.1)
    assert after["mae"] < 0.2 * before["mae"]
    assert best_model({"a": before, "b": after}, task="absolute") == "b"  # ranked by its own metric


def test_the_old_arch_hf_is_transformers_with_one_notice(monkeypatch, capsys):
    import mergeflow.schema.deprecation
    from mergeflow.models import family_of

    monkeypatch.setattr(mergeflow.schema.deprecation, "_shown", set())
    text = {"data": {"source": "text", "text": {"path": "csv", "data_files": "t.csv"}}, "fisher": {"kind": "sampled"}}
    old = validate_params(
        {**text, "model": {"arch": "hf", "hf": {"task": "causal_lm", "config": {"model_type": "gpt2"}}}}
    )
    new = {"arch": "transformers", "transformers": {"task": "causal_lm", "config": {"model_type": "gpt2"}}}
    assert old.section("model") == validate_params({**text, "model": new}).section("model")
    assert old.objective == "causal_lm" and old.pretrained is None
    notice = "mergeflow: deprecated: model.arch 'hf' is now 'transformers' (and model.hf is model.transformers)"
    assert capsys.readouterr().err.splitlines() == [notice]
    assert family_of("hf") is family_of("transformers")  # checkpoints saved with arch: hf still load
