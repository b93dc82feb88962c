"""Clients and a base given instead of trained (``finetune.checkpoints``, ``pretrain.checkpoint``): bit-identical
merges, exactly the dependents of an edited file re-run, LoRA adapters folded as PEFT folds them, one line per bad
source."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from conftest import fast_params, make_workspace, ran_steps, run_cli

from mergeflow.checkpoints import load_checkpoint, save_checkpoint
from mergeflow.config import Params
from mergeflow.given import PEFT_LORA, given_files, given_problems, resolve
from mergeflow.given_weights import read_given
from mergeflow.lora_fold import fold_lora

METHODS = ["average", "weighted", "task_arithmetic"]
MERGE = {"methods": METHODS, "options": {"task_arithmetic": {"scaling": 0.3}}}
QUICK = {"merge": MERGE, "federated": {"algorithms": [], "rounds": 1}, "tracking": {"log_models": False}}
MERGES = {f"merge/{method}" for method in METHODS}


def _merged(workspace) -> dict[str, dict[str, torch.Tensor]]:
    return {method: load_checkpoint(workspace / f"models/merged/{method}.safetensors")[0] for method in METHODS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cli_env):
    """A run that trains its 3 clients, then a run in another workspace given copies of two of them."""
    root = tmp_path_factory.mktemp("given")
    trained = make_workspace(root / "trained", fast_params(**QUICK))
    done = run_cli(["run"], trained, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    copies = {}
    for client in (0, 1):
        copies[client] = root / "given" / f"client_{client}.safetensors"
        copies[client].parent.mkdir(exist_ok=True)
        copies[client].write_bytes((trained / f"models/clients/client_{client:03d}.safetensors").read_bytes())
    params = fast_params(**QUICK)
    params["finetune"]["checkpoints"] = {client: str(path) for client, path in copies.items()}
    mixed = make_workspace(root / "mixed", params)
    done = run_cli(["run"], mixed, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    return trained, mixed, copies, ran_steps(mixed)


def test_given_copies_of_trained_clients_give_bit_identical_merges(runs):
    trained, mixed, copies, ran = runs
    assert {"finetune/client_000", "finetune/client_001", "finetune/client_002"} <= ran  # two read, one trained
    ours, theirs = _merged(trained), _merged(mixed)
    for method in METHODS:
        assert ours[method].keys() == theirs[method].keys()
        assert all(torch.equal(ours[method][key], theirs[method][key]) for key in ours[method]), method
    _, meta = load_checkpoint(mixed / "models/clients/client_001.safetensors")
    assert meta["given"]["kind"] == "mergeflow" and meta["given"]["source"] == str(copies[1])
    assert list(meta["given"]["files"]) == [str(copies[1])]
    assert meta["num_examples"] == load_checkpoint(trained / "models/clients/client_001.safetensors")[1]["num_examples"]


def test_a_pipeline_given_its_base_and_every_client_trains_none_of_them_and_merges_the_same(runs, cli_env, tmp_path):
    trained, *_ = runs
    given = tmp_path / "given"
    given.mkdir()
    for name in ("base/base", *(f"clients/client_{c:03d}" for c in range(3))):
        (given / f"{Path(name).name}.safetensors").write_bytes((trained / f"models/{name}.safetensors").read_bytes())
    params = fast_params(**QUICK)
    params["pretrain"]["checkpoint"] = str(given / "base.safetensors")
    params["finetune"]["checkpoints"] = {c: str(given / f"client_{c:03d}.safetensors") for c in range(3)}
    workspace = make_workspace(tmp_path / "run", params)
    done = run_cli(["run"], workspace, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    ours, theirs = _merged(trained), _merged(workspace)
    assert all(torch.equal(ours[m][key], theirs[m][key]) for m in METHODS for key in ours[m])
    base, meta = load_checkpoint(workspace / "models/base/base.safetensors")
    assert meta["given"]["kind"] == "mergeflow" and meta["role"] == "base"
    trained_base = load_checkpoint(trained / "models/base/base.safetensors")[0]
    assert all(torch.equal(base[key], trained_base[key]) for key in trained_base)
    steps = {step["name"]: step for step in json.loads((workspace / ".mergeflow/last_run.json").read_text())["steps"]}
    read = ("pretrain", *(f"finetune/client_{c:03d}" for c in range(3)))  # read, none trained
    assert all(steps[name]["summary"]["given"] == "mergeflow" for name in read)


def test_the_client_run_in_mlflow_records_where_it_came_from(runs):
    import mlflow

    _, mixed, copies, _ = runs
    mlflow.set_tracking_uri(f"sqlite:///{mixed / 'mlflow.db'}")
    clients = mlflow.search_runs(experiment_names=["mergeflow"], filter_string="tags.mergeflow.kind = 'client'")
    given = clients[clients["tags.mergeflow.client"] == "1"].iloc[0]
    _, meta = load_checkpoint(mixed / "models/clients/client_001.safetensors")
    assert given["params.given.source"] == str(copies[1]) and given["params.given.kind"] == "mergeflow"
    assert given["params.given.sha256"] == meta["given"]["files"][str(copies[1])]
    trained = clients[clients["tags.mergeflow.client"] == "2"].iloc[0]
    assert trained["params.epochs"] == "2" and not isinstance(trained["params.given.source"], str)


def test_an_unchanged_given_file_runs_nothing_and_an_edited_one_exactly_its_dependents(runs, cli_env):
    _, mixed, copies, _ = runs
    done = run_cli(["run"], mixed, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ran_steps(mixed) == set()
    state, meta = load_checkpoint(copies[1])
    first = next(iter(state))
    save_checkpoint(copies[1], state | {first: state[first] + 0.01}, meta)
    done = run_cli(["run"], mixed, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ran_steps(mixed) == {"finetune/client_001", "align", *MERGES, "evaluate", "track"}
    assert torch.equal(load_checkpoint(mixed / "models/clients/client_001.safetensors")[0][first], state[first] + 0.01)


def test_a_head_for_another_label_count_is_one_line_naming_the_key(runs, cli_env, tmp_path):
    from mergeflow.models.sequential import build_sequential_from_spec, model_spec

    trained, *_ = runs
    spec = model_spec("mlp", [1, 8, 8], 3, widths=[64])  # digits has 10 classes
    path = tmp_path / "three_classes.safetensors"
    save_checkpoint(path, build_sequential_from_spec(spec).state_dict(), {"spec": spec, "role": "client"})
    params = fast_params(**QUICK)
    params["finetune"]["checkpoints"] = {2: str(path)}
    workspace = make_workspace(tmp_path / "run", params)
    done = run_cli(["run"], workspace, cli_env)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if "error" in line]  # after the data stages' lines
    assert lines == [
        "mergeflow: error: finetune.checkpoints.2: its head has 3 outputs, and the base model's (the data's) 10"
    ]
    assert not (workspace / "models/clients/client_002.safetensors").exists()


def test_the_given_files_are_the_stages_dvc_deps(tmp_path):
    from tasks.dvcfile import render

    client = tmp_path / "client.safetensors"
    save_checkpoint(client, {"w": torch.zeros(1)}, {"spec": {"arch": "mlp", "widths": [64]}})
    params = Params.model_validate(
        fast_params(finetune={"checkpoints": {1: str(client)}}, pretrain={"checkpoint": str(client)})
    )
    stages = yaml.safe_load(render(given_files(params)))["stages"]
    assert str(client) in stages["finetune"]["deps"] and str(client) in stages["pretrain"]["deps"]
    assert all(
        str(client) not in stage["deps"] for name, stage in stages.items() if name not in ("finetune", "pretrain")
    )
    assert render() == render(given_files(Params()))


# --- LoRA adapters -------------------------------------------------------------------------------------------------


def _tiny_bert(path):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=16, num_labels=3,
    )  # fmt: skip
    BertForSequenceClassification(config).save_pretrained(path)
    return BertForSequenceClassification.from_pretrained(path)


def _adapter(base, path, **lora):
    """A LoRA adapter on ``base`` with every adapter tensor random and non-zero, saved under ``path``."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(base, LoraConfig(**lora))
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in peft_model.parameters():
            if parameter.requires_grad:
                parameter.normal_()
    peft_model.save_pretrained(path)
    return peft_model


LORAS = {
    "patterns": dict(
        r=4, lora_alpha=8, target_modules=["query", "value", "word_embeddings"], rank_pattern={"value": 2},
        alpha_pattern={"query": 3.0}, modules_to_save=["classifier"], bias="lora_only",
    ),
    "rslora": dict(r=4, lora_alpha=6, target_modules=["key", "dense"], use_rslora=True, lora_bias=True),
}  # fmt: skip


@pytest.mark.parametrize("lora", LORAS, ids=LORAS)
def test_a_lora_adapter_folds_as_by_hand_and_as_peft_merge_and_unload(lora, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    base = _tiny_bert(tmp_path / "base")
    base_state = {key: value.clone() for key, value in base.state_dict().items()}
    _adapter(base, tmp_path / "adapter", **LORAS[lora])
    adapter = load_file(tmp_path / "adapter/adapter_model.safetensors")
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    folded = fold_lora(base_state, adapter, config)

    from transformers import BertForSequenceClassification

    fresh = BertForSequenceClassification.from_pretrained(tmp_path / "base")
    peft_state = PeftModel.from_pretrained(fresh, tmp_path / "adapter").merge_and_unload().state_dict()
    assert folded.keys() == peft_state.keys()
    assert all(torch.equal(folded[key], peft_state[key]) for key in folded)

    module = (
        "bert.encoder.layer.1.attention.self.key" if lora == "rslora" else "bert.encoder.layer.0.attention.self.value"
    )
    a, b = (adapter[f"base_model.model.{module}.lora_{f}.weight"] for f in "AB")
    scale = 6 / math.sqrt(4) if lora == "rslora" else 8 / 2  # rsLoRA: alpha/sqrt(r); rank_pattern: value's r = 2
    by_hand = base_state[f"{module}.weight"] + (b @ a) * scale
    assert torch.equal(folded[f"{module}.weight"], by_hand)
    changed = {key for key in folded if not torch.equal(folded[key], base_state[key])}
    assert f"{module}.weight" in changed and "bert.encoder.layer.0.output.LayerNorm.weight" not in changed
    if lora == "patterns":  # the embedding, the saved head and the trained biases too
        assert {"bert.embeddings.word_embeddings.weight", "classifier.weight", f"{module}.bias"} <= changed


def test_an_adapter_client_is_read_onto_the_runs_base_under_its_names(tmp_path):
    base = _tiny_bert(tmp_path / "base")
    ours = {f"model.{key}": value.clone() for key, value in base.state_dict().items()}  # a TokenModel's names
    _adapter(base, tmp_path / "adapter", **LORAS["patterns"])
    given = resolve("finetune.checkpoints.0", str(tmp_path / "adapter"))
    assert given.kind == PEFT_LORA
    spec, state = read_given(given, ours, {"arch": "transformers", "output_dim": 3})
    assert spec == {"arch": "transformers", "output_dim": 3} and state.keys() == ours.keys()
    from safetensors.torch import load_file

    adapter = load_file(tmp_path / "adapter/adapter_model.safetensors")
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    folded = fold_lora({key.removeprefix("model."): value for key, value in ours.items()}, adapter, config)
    assert all(torch.equal(state[f"model.{key}"], value) for key, value in folded.items())
    hf_dir = resolve("finetune.checkpoints.1", str(tmp_path / "base"))
    _, state = read_given(hf_dir, ours, {"arch": "transformers", "output_dim": 3})
    assert all(torch.equal(state[key], ours[key]) for key in ours)
    with pytest.raises(ValueError, match="has shape"):
        read_given(hf_dir, ours | {"model.classifier.weight": torch.zeros(5, 16)}, {"output_dim": 5})


# --- bad sources: one line naming the key, exit 2, nothing written ---------------------------------------------------


def _validate(tmp_path, capsys, monkeypatch, **sections):
    from flows.cli import main

    workspace = make_workspace(tmp_path / "bad", fast_params(**sections))
    monkeypatch.chdir(workspace)
    code = main(["run"])
    assert sorted(p.name for p in workspace.iterdir()) == ["params.yaml"]  # nothing written
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "source, why",
    [
        ("/nowhere/client.safetensors", "/nowhere/client.safetensors: no such file or directory"),
        ("notes.txt", "not a safetensors file"),
        (".", "not a Hugging Face model directory (no config.json) nor a PEFT adapter directory"),
        ("someone/some-model", "'someone/some-model' is not a local path, and it cannot be downloaded (HF_HUB_OFFLINE"),
        ("cnn.safetensors", "a model of arch 'cnn', and model.arch is 'mlp'"),
        ("wide.safetensors", "a model of widths [32], and model.widths is [64]: another architecture"),
    ],
)
def test_a_bad_source_is_one_line_naming_its_key_before_any_work(source, why, tmp_path, capsys, monkeypatch):
    from mergeflow.models.sequential import build_sequential_from_spec, model_spec

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "notes.txt").write_text("not a model\n")
    for name, spec in (
        ("cnn", model_spec("cnn", [1, 8, 8], 10)),
        ("wide", model_spec("mlp", [1, 8, 8], 10, widths=[32])),
    ):
        save_checkpoint(tmp_path / f"{name}.safetensors", build_sequential_from_spec(spec).state_dict(), {"spec": spec})
    path = source if source.startswith(("/", "someone")) else str(tmp_path / source)
    code, lines = _validate(tmp_path, capsys, monkeypatch, finetune={"checkpoints": {2: path}})
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("mergeflow: error: params.yaml: finetune.checkpoints.2: ") and why in lines[0], lines


def test_given_checkpoints_of_other_shapes_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    from mergeflow.models.sequential import build_sequential_from_spec, model_spec

    spec = model_spec("mlp", [1, 8, 8], 10, widths=[64])
    state = build_sequential_from_spec(spec).state_dict()
    save_checkpoint(tmp_path / "base.safetensors", state, {"spec": spec})
    save_checkpoint(tmp_path / "other.safetensors", state | {"3.bias": torch.zeros(7)}, {"spec": spec})
    sections = {"finetune": {"checkpoints": {1: str(tmp_path / "other.safetensors")}}}
    code, lines = _validate(
        tmp_path, capsys, monkeypatch, pretrain={"checkpoint": str(tmp_path / "base.safetensors")}, **sections
    )
    assert code == 2
    assert lines == [
        "mergeflow: error: params.yaml: finetune.checkpoints.1: 3.bias has shape (7,), and pretrain.checkpoint's (10,)"
    ]


def test_an_adapter_of_another_base_is_refused_with_one_line(tmp_path):
    base = _tiny_bert(tmp_path / "base")
    _adapter(base, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=["query"])
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    (tmp_path / "adapter/adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": "org/other"}))
    text = {"source": "text", "text": {"path": "csv", "data_files": "texts.csv"}}
    model = {"arch": "transformers", "transformers": {"pretrained": str(tmp_path / "base")}}
    adapters = {"checkpoints": {0: str(tmp_path / "adapter")}}
    raw = fast_params(data=text, model=model, pretrain={"enabled": False}, finetune=adapters)
    params = Params.model_validate(raw)
    assert given_problems(params) == [
        f"finetune.checkpoints.0: an adapter of 'org/other', and this run's base is '{tmp_path / 'base'}'"
    ]
    (tmp_path / "adapter/adapter_config.json").write_text(
        json.dumps(config | {"base_model_name_or_path": str(tmp_path / "base")})
    )
    assert given_problems(params) == []
    trained_further = Params.model_validate(raw | {"pretrain": {"enabled": True}})
    assert given_problems(trained_further)[0].startswith("finetune.checkpoints.0: an adapter folds onto the pretrained")
