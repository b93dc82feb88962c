"""Malformed params, overrides and inputs: one clear error line naming the key or file, exit 2, nothing written."""

from __future__ import annotations

import os

import pytest
import yaml
from conftest import make_workspace, pipeline_params

from flows.cli import main

# (overrides, text the error must contain); each runs `mergeflow run` on the tests' own params.
CASES = [
    (["partition.alpha=0"], "partition.alpha"),
    (["partition.alpha=-0.5"], "partition.alpha"),
    (["partition.num_clients=many"], "partition.num_clients"),
    (["partition.num_clients=100000"], "partition.num_clients"),
    (["partition.method=natural"], "partition.method"),
    (["data.source=imagenet"], "data.source"),
    (["data.test_fraction=-0.2"], "data.test_fraction"),
    (["data.standardize=sometimes"], "data.standardize"),
    (["data.categorical=ordinal"], "data.categorical"),
    (["data.missing=median"], "data.missing"),
    (["data.source=table", "data.table.path=csv", "data.table.data_files=missing.csv"], "missing.csv"),
    (["data.source=table"], "data.table.path"),
    (["data.pinwheel.clusters=1"], "data.pinwheel.clusters"),
    (["model.widths=[64, 0]"], "model.widths"),
    (["model.arch=transformer"], "model.arch"),
    (["finetune.lr=-1"], "finetune.lr"),
    (["finetune.optimizer=rmsprop"], "finetune.optimizer"),
    (["finetune.clients.42.lr=0.1"], "finetune.clients.42"),
    (["finetune.init=pretrained"], "finetune.init"),
    (["fisher.kind=hessian"], "fisher.kind"),
    (["merge.methods=[average, magic]"], "merge.methods[1]"),
    (["merge.options.ssf.mask_rate=2"], "merge.options.ssf.mask_rate"),
    (["merge.options.ties.density=0"], "merge.options.ties.density"),
    (["merge.options.ties.density=1.5"], "merge.options.ties.density"),
    (["merge.options.dare_ties.drop_rate=1"], "merge.options.dare_ties.drop_rate"),
    (["merge.options.breadcrumbs={density: 0.9, gamma: 0.2}"], "merge.options.breadcrumbs.gamma"),
    (["merge.options.della.epsilon=[0.1, 0.6]"], "merge.options.della.epsilon"),
    (["merge.methods=[slerp]"], "slerp"),
    (["merge.options.regmean.alpha=0"], "merge.options.regmean.alpha"),
    (["merge.methods=[greedy_soup]"], "data.validation_fraction"),
    (["merge.options.task_arithmetic.scaling=[]"], "merge.options.task_arithmetic.scaling"),
    (["merge.options.fisher.unknown=1"], "merge.options.fisher.unknown"),
    (["merge.options.exact.tolerance=0"], "merge.options.exact.tolerance"),
    (["align.method=telepathy"], "align.method"),
    (["align.reference=7"], "align.reference"),
    (["align.repair=true"], "align.repair: REPAIR rescales aligned models"),
    (["align.barrier_points=2"], "align.barrier_points"),
    (["federated.algorithms=[fedavg, fedmagic]"], "federated.algorithms[1]"),
    (["federated.options.fedprox.mu=-1"], "federated.options.fedprox.mu"),
    (["federated.options.fedavg.local.lr=0"], "federated.options.fedavg.local.lr: "),
    (["federated.options={fedavg: {local: 3}}"], "federated.options.fedavg.local: "),
    (["federated.rounds=0"], "federated.rounds"),
    (["federated.fraction=1.5"], "federated.fraction"),
    (["federated.algorithms=[fedavg]", "federated.aggregator={name: krum, f: 2}"], "federated.aggregator.f: krum"),
    (["federated.aggregator={name: trimmed_mean, beta: 0.5}"], "federated.aggregator.beta"),
    (["federated.aggregator=median"], "federated.aggregator: 'fedadmm'"),
    (["federated.server={optimizer: adam}"], "federated.server: 'bayes_admm'"),
    (["federated.algorithms=[fedavg]", "federated.dp={noise_multiplier: -1}"], "federated.dp.noise_multiplier"),
    (["federated.algorithms=[fedavg]", "federated.dp={target_epsilon: 0.05}"], "federated.dp.target_epsilon"),
    (["federated.attack={clients: 6}"], "federated.attack.clients"),
    (["orchestration.task_runner=spark"], "orchestration.task_runner"),
    (["orchestration.device=gpu"], "orchestration.device"),
    (["orchestration.device=cuda:99"], "orchestration.device"),  # no machine has 100 GPUs
    (["finetune.precision=fp8"], "finetune.precision"),
    (["evaluate.ece_bins=0"], "evaluate.ece_bins"),
    (["seed=not-a-number"], "seed"),
    (["nonsense.key=1"], "nonsense"),
    (["no-equals-sign"], "KEY=VALUE"),
]


@pytest.fixture()
def workspace(tmp_path, monkeypatch):
    make_workspace(tmp_path, pipeline_params())
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _errors(capsys) -> list[str]:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and all(line.startswith("mergeflow: error: ") for line in lines), lines
    return lines


@pytest.mark.parametrize(("overrides", "needle"), CASES, ids=[" ".join(o) for o, _ in CASES])
def test_bad_params_give_one_line_naming_the_key_exit_2_and_write_nothing(workspace, capsys, overrides, needle):
    code = main(["run", *[arg for o in overrides for arg in ("-S", o)]])
    assert code == 2
    lines = _errors(capsys)
    assert len(lines) == 1, lines
    assert needle in lines[0]
    assert sorted(os.listdir(workspace)) == ["params.yaml"]


@pytest.mark.parametrize(
    ("content", "needle"),
    [("partition: [1, 2\n", "not valid YAML"), ("- a\n- b\n", "expected a mapping"), (None, "not found")],
)
def test_bad_params_files_are_named(workspace, capsys, content, needle):
    path = workspace / "other.yaml"
    if content is not None:
        path.write_text(content)
    assert main(["run", "--params", str(path)]) == 2
    lines = _errors(capsys)
    assert "other.yaml" in lines[0] and needle in lines[0]
    assert not (workspace / ".mergeflow").exists()


def test_many_problems_get_one_line_each(workspace, capsys):
    raw = yaml.safe_load((workspace / "params.yaml").read_text())
    raw["partition"]["alpha"] = 0
    raw["finetune"]["lr"] = -1
    (workspace / "params.yaml").write_text(yaml.safe_dump(raw))
    assert main(["run"]) == 2
    lines = _errors(capsys)
    assert len(lines) == 2
    assert any("partition.alpha" in line for line in lines) and any("finetune.lr" in line for line in lines)
