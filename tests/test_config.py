"""Params validation: one clear line naming the key, and -S overrides with YAML rules."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from conftest import run_cli

from mergeflow.config import apply_overrides, load_params, validate_params
from mergeflow.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_committed_params_are_valid():
    params = load_params(ROOT / "params.yaml")
    assert params.partition.num_clients >= 2
    assert params.merge.methods


@pytest.mark.parametrize("lora", [False, True])
def test_validate_imports_no_torch(tmp_path, lora):
    """Params validate from the torch-free schema (``mergeflow.schema``), LoRA included (its target modules
    are checked when a run starts): well under a second."""
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    overrides = []
    if lora:  # a text table (read here, with datasets) for a transformer with LoRA adapters
        (tmp_path / "t.csv").write_text("text,label\n" + "".join(f"word{i} text,{i % 2}\n" for i in range(40)))
        overrides = ["data.source=text", "data.text.path=csv", "data.text.data_files=t.csv", "model.arch=transformers"]
        overrides.append("finetune.lora={r: 4, alpha: 8, target_modules: [query, value]}")
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    done = run_cli(["validate", *(arg for o in overrides for arg in ("-S", o))], tmp_path, env)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "mergeflow.config" in imported and not {"torch", "prefect", "mlflow", "transformers"} & imported
    assert lora or "datasets" not in imported


def test_the_schema_reads_no_file_and_the_preflight_names_each_missing_one(tmp_path):
    from mergeflow.errors import ConfigError
    from mergeflow.preflight import check_paths

    raw = apply_overrides({}, ["data.source=table", "data.table.path=csv", "data.table.data_files=[a.csv, b.csv]"])
    params = validate_params(raw)  # no disk access here: the flow and every sweep point validate again
    (tmp_path / "b.csv").write_text("x,label\n1,0\n")
    params = params.model_copy(
        update={
            "data": params.data.model_copy(
                update={
                    "table": params.data.table.model_copy(
                        update={"data_files": [str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]}
                    )
                }
            )
        }
    )
    with pytest.raises(ConfigError) as error:
        check_paths(params, "p.yaml")
    assert error.value.lines == [f"p.yaml: data.table.data_files: file not found: {tmp_path / 'a.csv'}"]


def test_overrides_parse_yaml_values():
    raw = apply_overrides({"merge": {"methods": ["average"]}}, ["merge.methods=[average, weighted]", "seed=3"])
    assert raw == {"merge": {"methods": ["average", "weighted"]}, "seed": 3}


def test_client_override_keys_become_ints():
    params = validate_params(apply_overrides({}, ["finetune.clients.1.lr=0.2"]))
    assert params.finetune.with_override(params.finetune.clients[1]).lr == 0.2
    assert params.finetune.with_override(params.finetune.clients.get(0)).lr == params.finetune.lr


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("partition.alpha=0", "partition.alpha"),
        ("partition.alpha=-1", "partition.alpha"),
        ("partition.num_clients=abc", "partition.num_clients"),
        ("partition.num_clients=5000", "partition.num_clients"),
        ("merge.methods=[average, nope]", "methods[1]"),
        ("merge.options.task_arithmetic.bogus=1", "merge.options.task_arithmetic.bogus"),
        ("data.source=mnist", "data.source"),
        ("finetune.lr=-0.1", "finetune.lr"),
        ("finetune.clients.9.lr=0.1", "finetune.clients.9"),
        ("surprise=1", "surprise"),
        ("model.arch=cnn", "model.arch"),
        ("data.test_fraction=1.5", "data.test_fraction"),
        ("data.server_fraction=0", "pretrain.enabled"),
    ],
)
def test_bad_values_name_their_key(override, key):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    if override == "model.arch=cnn":
        raw["data"]["source"] = "wine"
    with pytest.raises(ConfigError) as error:
        validate_params(apply_overrides(raw, [override]), "params.yaml")
    assert key in str(error.value)
    assert all(line.startswith("params.yaml:") for line in error.value.lines)


def test_unknown_key_is_reported_as_unknown():
    with pytest.raises(ConfigError, match=r"data\.sorce: unknown key"):
        validate_params({"data": {"sorce": "digits"}})


def test_missing_params_file(tmp_path):
    with pytest.raises(ConfigError, match="params file not found"):
        load_params(tmp_path / "nope.yaml")


def test_malformed_override():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_params(ROOT / "params.yaml", ["novalue"])


def test_merge_variants_run_one_method_with_several_settings():
    raw = {
        "merge": {
            "methods": ["ssf", "ssf_20", "avg"],
            "options": {"ssf_20": {"method": "ssf", "mask_rate": 0.2}, "avg": {"method": "average"}},
        }
    }
    merge = validate_params(raw).merge
    assert merge.method_of("ssf_20") == "ssf" and merge.method_of("avg") == "average"
    (ssf_20,) = merge.resolve("ssf_20").candidates
    assert ssf_20.mask_rate == 0.2 and ssf_20.model_dump(exclude_unset=True) == {"mask_rate": 0.2}
    assert merge.resolve("ssf").candidates[0].model_dump(exclude_unset=True) == {}
    assert merge.resolve("avg").method == "average"


def test_a_search_entry_resolves_to_one_validated_options_model_per_candidate():
    raw = {
        "data": {"validation_fraction": 0.2},
        "merge": {"methods": ["d"], "options": {"d": {"method": "della", "density": [0.3, 0.5], "epsilon": 0.1}}},
    }
    entry = validate_params(raw).merge.resolve("d")
    assert entry.method == "della" and entry.searched == ("density",)
    assert [(c.density, c.epsilon) for c in entry.candidates] == [(0.3, 0.1), (0.5, 0.1)]


def test_a_federated_entry_resolves_to_its_algorithm_options_without_its_own_sections():
    raw = {
        "federated": {"algorithms": ["p"], "options": {"p": {"algorithm": "fedprox", "mu": 0.1, "local": {"lr": 0.1}}}}
    }
    algorithm, options = validate_params(raw).federated.resolve("p")
    assert algorithm == "fedprox" and options.model_dump(exclude_unset=True) == {"mu": 0.1}


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"v": {"method": "nope"}}, "merge.options.v.method"),
        ({"v": {"method": "ssf", "mask_rate": 2}}, "merge.options.v.mask_rate"),
        ({"v": {"method": "average", "scaling": 1}}, "merge.options.v.scaling"),
    ],
)
def test_bad_merge_variants_name_their_key(options, key):
    with pytest.raises(ConfigError) as error:
        validate_params({"merge": {"methods": ["v"], "options": options}})
    assert key in str(error.value)


def test_steps_per_task_is_auto_or_positive():
    from mergeflow.config import OrchestrationConfig

    assert OrchestrationConfig().steps_per_task == "auto"
    with pytest.raises(ValueError, match="must be 'auto' or at least 1"):
        OrchestrationConfig(steps_per_task=0)


def test_a_bad_override_names_the_override_not_the_file(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("finetune:\n  epochs: -1\n")
    with pytest.raises(ConfigError) as error:
        load_params(path, ["finetune.lr=-0.1", "merge.methods=[average]"])
    lines = sorted(error.value.lines)
    assert lines[0].startswith("-S finetune.lr=-0.1: finetune.lr:"), lines
    assert lines[1].startswith(f"{path}: finetune.epochs:"), lines  # the file's own mistake still names the file


def test_validation_leaves_the_params_as_given_and_the_readers_resolve_them():
    text = {"data": {"source": "text", "text": {"path": "x.csv"}}, "model": {"arch": "transformers"}}
    params = validate_params(text)
    assert params.align.examples is None and params.model.transformers.config is None
    assert params.align_settings.examples == 256 and params.align_settings.barrier_points == 5
    assert params.model.transformers.model_config_fields()["model_type"] == "bert"
    mlp = validate_params({"align": {"barrier_points": 7}})
    assert (mlp.align_settings.examples, mlp.align_settings.barrier_points) == (512, 7)
    assert mlp.align.examples is None
