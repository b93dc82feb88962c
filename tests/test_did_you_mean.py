"""A near-miss key or name gets one line naming it and the known one it most looks like, exit code 2."""

from __future__ import annotations

import pytest
from conftest import make_workspace, pipeline_params

from flows.cli import main

# (overrides, the whole message after "-S <the last override>: ", the override that set the key)
CASES = [
    (["partition.num_clent=3"], "partition.num_clent: unknown key; did you mean partition.num_clients?"),
    (["partiton.alpha=1"], "partiton: unknown key; did you mean partition?"),
    (["data.tabel.path=csv"], "data.tabel: unknown key; did you mean data.table?"),
    (["data.table.pth=csv"], "data.table.pth: unknown key; did you mean data.table.path?"),
    (["finetune.clients.1.lrr=0.1"], "finetune.clients.1.lrr: unknown key; did you mean finetune.clients.1.lr?"),
    (["finetune.lora.rr=4"], "finetune.lora.rr: unknown key; did you mean finetune.lora.r?"),
    (
        ["merge.options.ties.densty=0.5"],
        "merge.options.ties.densty: unknown key; did you mean merge.options.ties.density?",
    ),
    (
        ["merge.options.s20.method=ssf", "merge.options.s20.mask_rat=0.2"],
        "merge.options.s20.mask_rat: unknown key; did you mean merge.options.s20.mask_rate?",
    ),
    (
        ["federated.options.fedprox.muu=1"],
        "federated.options.fedprox.muu: unknown key; did you mean federated.options.fedprox.mu?",
    ),
    (
        ["federated.options.fedavg.local.lrr=1"],
        "federated.options.fedavg.local.lrr: unknown key; did you mean federated.options.fedavg.local.lr?",
    ),
    (["partition.zzz=1"], "partition.zzz: unknown key"),
]

# (overrides, what the line says about the name)
NAMES = [
    (
        ["merge.methods=[averag]"],
        "merge.methods[0]: unknown method 'averag' (did you mean 'average'?); known: average,",
    ),
    (["merge.options.tie.density=0.5"], "merge.options.tie: unknown method 'tie' (did you mean 'ties'?); known:"),
    (["federated.algorithms=[fedav]"], "federated.algorithms[0]: unknown algorithm 'fedav' (did you mean 'fedavg'?)"),
    (["data.source=digts"], "data.source: unknown data source 'digts' (did you mean 'digits'?); known: digits,"),
    (["model.arch=mpl"], "model.arch: 'mpl' is unknown (did you mean 'mlp'?); known: linear, mlp"),
]


@pytest.fixture()
def workspace(tmp_path, monkeypatch):
    make_workspace(tmp_path, pipeline_params())
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _one_error(capsys, source: str = "params.yaml") -> str:
    """The one error line's message after ``source``: where the key was given."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mergeflow: error: {source}: "), lines
    return lines[0].removeprefix(f"mergeflow: error: {source}: ")


@pytest.mark.parametrize(("overrides", "expected"), CASES, ids=[" ".join(o) for o, _ in CASES])
def test_an_unknown_key_suggests_the_closest_known_one(workspace, capsys, overrides, expected):
    assert main(["validate", *[arg for o in overrides for arg in ("-S", o)]]) == 2
    assert _one_error(capsys, f"-S {overrides[-1]}") == expected


@pytest.mark.parametrize(("overrides", "expected"), NAMES, ids=[" ".join(o) for o, _ in NAMES])
def test_an_unknown_name_suggests_the_closest_registered_one(workspace, capsys, overrides, expected):
    assert main(["validate", *[arg for o in overrides for arg in ("-S", o)]]) == 2
    assert _one_error(capsys, f"-S {overrides[-1]}").startswith(expected)


def test_a_misspelt_section_in_the_params_file(workspace, capsys):
    text = (workspace / "params.yaml").read_text().replace("partition:", "partiton:", 1)
    (workspace / "params.yaml").write_text(text)
    assert main(["validate"]) == 2
    assert _one_error(capsys) == "partiton: unknown key; did you mean partition?"
