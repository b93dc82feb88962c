"""Adding a data source is one declaration module and one loader module: in a copy of the code tree, the
two files of ``tests/blobs_source.py`` (and no edit of any other) make ``data.source: blobs`` validate, plan
and load."""

from __future__ import annotations

import json
from pathlib import Path

from blobs_source import DECLARATION, LOADER, add_blobs
from code_copies import copy_code, digests, edited, run_on

_CHECK = """
import json

import mergeflow.config
from mergeflow.config import validate_params
from mergeflow.errors import ConfigError
from mergeflow.schema.sources import get_source
from tasks.data import plan_prepare

params = validate_params({"data": {"source": "blobs", "blobs": {"n": 120}}, "partition": {"num_clients": 3}})
try:
    validate_params({"data": {"source": "blobs", "blobs": {"n": 5}}})
    refused = None
except ConfigError as error:
    refused = str(error)
(prepare,) = plan_prepare(params)
source = get_source("blobs")
dataset, info = source.loader.load(params.data.options, seed=0)
print(json.dumps({
    "package": mergeflow.config.__file__,
    "options": params.section("data")["blobs"],
    "rows": dataset.num_rows,
    "labels": sorted(set(dataset["y"])),
    "info": info,
    "refused": refused,
    "prepare": {"params": prepare.params["data"], "members": prepare.members, "code": prepare.code},
}))
"""


def test_a_new_source_is_one_declaration_module_and_one_loader_module(tmp_path):
    code_root = copy_code(tmp_path / "code")
    before = digests(code_root)
    add_blobs(code_root)
    assert edited(before, digests(code_root)) == {DECLARATION, LOADER}

    done = run_on(code_root, _CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    assert Path(seen["package"]).is_relative_to(code_root)  # the copy's code, not this checkout's
    assert seen["options"] == {"n": 120, "classes": 3, "spread": 0.5}
    assert "data.blobs.n: Input should be greater than or equal to 10" in seen["refused"]
    assert seen["rows"] == 120 and seen["labels"] == [0, 1, 2]
    assert seen["info"]["source"] == "blobs" and seen["info"]["input_shape"] == [2]
    prepare = seen["prepare"]
    assert prepare["params"]["blobs"] == seen["options"] and prepare["params"]["source"] == "blobs"
    assert prepare["members"] == ["mergeflow.schema.sources.blobs", "mergeflow.data.blobs"]
    assert {DECLARATION, LOADER} <= set(prepare["code"])
