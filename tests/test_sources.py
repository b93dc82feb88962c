"""The data-source registry: a new source is one declaration, and the old name ``hf`` still works."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import make_workspace, pipeline_params, run_cli
from pydantic import BaseModel, ConfigDict, Field

import mergeflow.schema.deprecation
from mergeflow.config import validate_params
from mergeflow.data.loader import SourceLoader
from mergeflow.data.rows import make_dataset
from mergeflow.errors import ConfigError
from mergeflow.schema.sources import SOURCES, DataSource, get_source, register_source


class CirclesOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = Field(200, ge=10)
    noise: float = Field(0.05, ge=0)


class CirclesLoader(SourceLoader):
    """Two noisy concentric circles, as a loader module of its own would read them."""

    def load(self, options: CirclesOptions, *, seed=0, data=None):
        rng = np.random.default_rng(seed)
        y = np.arange(options.n) % 2
        angle = rng.uniform(0, 2 * np.pi, options.n)
        x = np.stack([np.cos(angle), np.sin(angle)], 1) * (1 + y)[:, None]
        x += options.noise * rng.standard_normal(x.shape)
        info = {"source": self.source.name, "task": "classification", "num_classes": 2, "input_shape": [2]}
        return make_dataset(x, y.astype(np.int64)), info | {"class_names": None}


@pytest.fixture()
def circles():
    """A source declared and registered here, as a module of its own would: options, facts and its loader."""

    @register_source
    class Circles(DataSource):
        """Two noisy concentric circles; the class is the circle."""

        name = "circles"
        Options = CirclesOptions
        implementation = f"{__name__}:CirclesLoader"

        def known_rows(self, options: CirclesOptions) -> int:
            return options.n

    yield Circles
    SOURCES.pop("circles")


def test_a_new_source_is_one_declaration(circles, tmp_path):
    from tasks.data import prepare
    from tasks.prepared import read_info

    params = validate_params({"data": {"source": "circles", "circles": {"n": 100}}, "partition": {"num_clients": 3}})
    assert (params.data.task, params.data.modality, params.data.is_text) == ("classification", "features", False)
    assert params.section("data")["circles"] == {"n": 100, "noise": 0.05}
    with pytest.raises(ConfigError, match=r"data\.circles\.n: Input should be greater"):
        validate_params({"data": {"source": "circles", "circles": {"n": 5}}})
    with pytest.raises(ConfigError, match=r"data\.circles\.radius: unknown key"):
        validate_params({"data": {"source": "circles", "circles": {"radius": 2}}})
    with pytest.raises(ConfigError, match="partition.num_clients: 90 clients but only 70 training samples"):
        validate_params({"data": {"source": "circles", "circles": {"n": 100}}, "partition": {"num_clients": 90}})
    with pytest.raises(ConfigError, match="model.arch: 'cnn' needs image-shaped data"):
        validate_params({"data": {"source": "circles"}, "model": {"arch": "cnn"}})

    sizes = prepare({"seed": 0, "data": params.section("data")}, tmp_path, tmp_path, {})
    assert sum(sizes.values()) == 100 and read_info(tmp_path)["source"] == "circles"


def test_the_old_name_hf_is_table_with_one_notice(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(mergeflow.schema.deprecation, "_shown", set())
    old = {"data": {"source": "hf", "hf": {"path": "csv", "data_files": "t.csv", "label_column": "y"}}}
    new = {"data": {"source": "table", "table": {"path": "csv", "data_files": "t.csv", "label_column": "y"}}}
    assert validate_params(old).section("data") == validate_params(new).section("data")
    assert validate_params(old).data.source == "table" and get_source("hf") is get_source("table")
    notice = "mergeflow: deprecated: data.source 'hf' is now 'table' (and data.hf is data.table)"
    assert capsys.readouterr().err.splitlines() == [notice]
    both = validate_params({"data": {**new["data"], "hf": {"path": "json"}}}).data.table
    assert (both.path, both.label_column) == ("json", "y")

    make_workspace(tmp_path, pipeline_params())
    (tmp_path / "t.csv").write_text("a,y\n" + "".join(f"{i},{i % 2}\n" for i in range(40)))
    overrides = ["data.source=hf", "data.hf.path=csv", "data.hf.data_files=t.csv", "data.hf.label_column=y"]
    done = run_cli(["validate", *(arg for o in overrides for arg in ("-S", o))], tmp_path, dict(os.environ))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("mergeflow: deprecated:") == 1 and notice in done.stderr
