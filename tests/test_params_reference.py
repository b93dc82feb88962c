"""docs/params.md is generated from the params schema and kept current (``mergeflow params-doc``)."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT
from pydantic import BaseModel, Field

from flows.cli import main
from mergeflow.config import Params
from mergeflow.params_reference import _table, render
from mergeflow.schema import federated, merge


def test_committed_params_reference_is_generated_from_the_schema():
    assert (ROOT / "docs/params.md").read_text() == render(), "run `mergeflow params-doc --write`"


def _keys(model: type[BaseModel], path: str = "") -> list[tuple[str, str, type[BaseModel]]]:
    """(section path, key, section model) of every key of the schema, sections within sections too."""
    from mergeflow.params_reference import _is_mapping, _nested_model

    found = []
    for name, field in model.model_fields.items():
        found.append((path, name, model))
        nested = _nested_model(field.annotation)
        if nested is not None:
            child = f"{path}.{name}" if path else name
            found += _keys(nested, f"{child}.N" if _is_mapping(field.annotation) else child)
    return found


def _part(text: str, heading: str) -> str:
    """The text under a heading, up to the next heading."""
    start = text.index(f" {heading}\n")
    end = text.find("\n#", start)
    return text[start : end if end > 0 else None]


def test_every_key_method_and_algorithm_has_its_row_with_type_default_and_constraints():
    text = render()
    for path, key, _ in _keys(Params):
        assert f"| `{key}` |" in _part(text, f"`{path}`" if path else "Top level"), f"{path}.{key}"
    for name, declaration in merge.DECLARED.items():
        part = _part(text, f"`merge.options.{name}`")
        assert all(f"| `{key}` |" in part for key in declaration.Options.model_fields), name
        assert all(f"`{need}`" in part for need in declaration.uses), name
    for name, declaration in federated.ALGORITHMS.items():
        part = _part(text, f"`federated.options.{name}`")
        assert all(f"| `{key}` |" in part for key in declaration.Options.model_fields), name
    fisher = _part(text, "`fisher`")
    assert "| `kind` | one of `empirical`, `sampled`, `exact` | `exact` |  |" in fisher
    assert "| `n_examples` | int | `1024` | ≥ 1 |" in fisher
    assert "| `factor_memory_mb` | float or null | `null` | > 0 |" in fisher
    assert "| `reference` | int or `largest` | `largest` |  |" in _part(text, "`align`")
    assert "| `texts` | list of any of `definition`," in _part(text, "`data.wordnet`")
    assert "Per-client Fisher estimation" in fisher  # the section's docstring
    assert "| `clip_radius` | float | `.inf` | > 0.0 |" in _part(text, "`federated.options.bayes_admm`")


def test_a_field_description_gets_a_column():
    class Options(BaseModel):
        """Docstring."""

        rate: float = Field(0.5, gt=0, le=1, description="the share | kept")
        steps: int = 3

    table = _table(Options, "")
    assert table.splitlines()[0] == "| key | type | default | constraints | description |"
    assert "| `rate` | float | `0.5` | > 0, ≤ 1 | the share \\| kept |" in table
    assert "| `steps` | int | `3` |  |  |" in table


def test_the_command_prints_or_writes_the_reference(tmp_path, monkeypatch, capsys):
    assert main(["params-doc"]) == 0
    assert capsys.readouterr().out == render()
    monkeypatch.chdir(tmp_path)
    assert main(["params-doc", "--write"]) == 0
    assert (tmp_path / "docs/params.md").read_text() == render()


def test_generating_the_reference_imports_no_torch():
    code = "import sys; from mergeflow.params_reference import render; render(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
