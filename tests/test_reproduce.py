"""`mergeflow reproduce`: each reproduction is declared once (name, default preset, runner), and the command line
offers exactly those."""

from __future__ import annotations

import pytest
from conftest import ROOT, run_cli

from flows.reproduction_registry import REPRODUCTIONS
from mergeflow.errors import ConfigError


def test_every_declared_reproduction_has_its_preset_and_runner():
    assert list(REPRODUCTIONS) == [
        *("linear-gaussian", "pinwheel", "alignment", "federated", "participation", "merges", "averaging-laws"),
        *("robustness", "privacy"),
    ]
    for name, reproduction in REPRODUCTIONS.items():
        assert (ROOT / reproduction.preset).is_file(), name
        assert callable(reproduction.load()), name
    assert REPRODUCTIONS["participation"].load() is REPRODUCTIONS["federated"].load()


def test_the_command_line_offers_the_declared_reproductions(capsys):
    from flows.cli import main

    with pytest.raises(SystemExit):
        main(["reproduce", "--help"])
    assert "{" + ",".join(REPRODUCTIONS) + "}" in capsys.readouterr().out


def test_an_unknown_reproduction_gets_a_did_you_mean(tmp_path):
    from flows.reproduce import reproduce

    with pytest.raises(ConfigError, match=r"reproduce: reproduction 'merge' is unknown \(did you mean 'merges'\?\)"):
        reproduce("merge", tmp_path)


def test_the_pinwheel_reproduction_with_replicated_clients_names_its_outputs_by_the_preset(tmp_path, cli_env):
    """The paper-clients preset, shrunk: every client holds the whole training split, the centralized oracle trains
    on it once, the searched prior precision is chosen on validation, and the table orders the merges."""
    import json

    import yaml

    preset = yaml.safe_load((ROOT / "experiments" / "pinwheel_paper.yaml").read_text())
    preset["sweep"] = {"partition.num_clients": [2], "seed": [0]}
    preset["clients"] = [{"epochs": 2, "lr": 0.01}, {"epochs": 3, "lr": 0.015}]
    params = preset["params"]
    params["data"]["pinwheel"]["per_cluster"] = 100
    params["finetune"]["epochs"] = 3
    params["fisher"] |= {"n_examples": 35, "rank_examples": 35}
    params["merge"] = {
        "methods": ["average", "ssf_20", "exact"],
        "select_by": "nll",
        "options": {
            "exact": {"prior_precision": [0.01, 100]},
            "ssf_20": params["merge"]["options"]["ssf_20"] | {"steps": 5, "prior_precision": 1},
        },
    }
    (tmp_path / "paper_clients.yaml").write_text(yaml.safe_dump(preset))
    done = run_cli(["reproduce", "pinwheel", "--preset", "paper_clients.yaml"], tmp_path, cli_env)
    assert done.returncode == 0, done.stderr
    table = (tmp_path / "results" / "paper_clients.md").read_text()
    assert "average < " in table or " < average" in table
    assert "| 2 | exact | prior_precision=" in table
    (run,) = json.loads((tmp_path / "results" / "paper_clients.json").read_text())["runs"]
    workspace = tmp_path / "results" / "paper_clients-workspace"
    sizes = json.loads((workspace / "metrics" / "partition.json").read_text())["sizes"]
    assert sizes == [35, 35]  # 7% of 500 points, each client all of them
    from mergeflow.checkpoints import load_checkpoint_meta

    assert load_checkpoint_meta(workspace / "models" / "centralized" / "centralized.safetensors")["num_examples"] == 35
    assert run["selection"]["exact"]["searched"] == ["prior_precision"]
