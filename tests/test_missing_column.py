"""A table without the configured label column: one line naming the option to set, exit code 2, before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import pipeline_params

from flows.cli import main


@pytest.fixture()
def workspace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _write_params(workspace: Path, source: str, section: dict) -> None:
    params = pipeline_params()
    params["data"] = {"source": source, source: {"path": "csv", "data_files": str(workspace / "t.csv"), **section}}
    if source == "text":
        params["model"] = {"arch": "transformers"}
    (workspace / "params.yaml").write_text(yaml.safe_dump(params))


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_missing_label_column_names_the_key(workspace, capsys, command):
    (workspace / "t.csv").write_text("a,b,y\n1,2,0\n3,4,1\n")
    _write_params(workspace, "table", {})
    assert main([command]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["mergeflow: error: data.table.label_column: no column 'label' in the table; columns: a, b, y"], (
        lines
    )
    assert not (workspace / "data").exists()


def test_a_near_miss_column_is_suggested(workspace, capsys):
    (workspace / "t.csv").write_text("text,labels\nhello,a\nworld,b\n")
    _write_params(workspace, "text", {})
    assert main(["validate"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        "mergeflow: error: data.text.label_column: no column 'label' in the table (did you mean 'labels'?); "
        "columns: text, labels"
    )
