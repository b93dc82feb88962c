"""Adding a model family is one declaration plus one module: in a copy of the code tree, a tiny MLP variant
under a new arch validates, builds, round-trips its state through its spec, aligns and keys its steps, with
no other file edited."""

from __future__ import annotations

import textwrap

from code_copies import copy_code, digests, edited, run_on

DECLARATION = '''

class TinyOptions(BaseModel):
    """The hidden layer's ``width``."""

    model_config = ConfigDict(extra="forbid")
    width: int = Field(8, ge=1)


@declare_family
class Tiny(FamilyDeclaration):
    """An MLP with one hidden layer of ``model.tiny.width`` units."""

    name = "tiny"
    archs = ("tiny",)
    Options = TinyOptions
    implementation = "mergeflow.models.tiny:TinyFamily"
    inputs = "features"
    permutation_spec = "mergeflow.align.derive:traced_spec"
    backpack = True
    language_models = False
    flavour = "pyfunc"
'''

MODULE = '''"""An MLP with one hidden layer of ``model.tiny.width`` units, as plain ``nn.Sequential``."""

from typing import Any

from torch import nn

from mergeflow.models.family import ModelFamily
from mergeflow.models.sequential import build_sequential_from_spec, model_spec


class TinyFamily(ModelFamily):
    """``model.arch: tiny``."""

    def build_base(self, model: dict[str, Any], info: dict[str, Any], output_dim: int, seed: int):
        width = model["tiny"]["width"]
        spec = model_spec("mlp", info["input_shape"], output_dim, widths=[width], seed=seed) | {"arch": "tiny"}
        return self.from_spec(spec), spec

    def from_spec(self, spec: dict[str, Any]) -> nn.Module:
        return build_sequential_from_spec(spec | {"arch": "mlp"})
'''

# Run with only the copy on the path: validate, build, reload, align, document and key the new family.
CHECK = """
import sys

import torch

from mergeflow.align.derive import model_permutation_spec
from mergeflow.config import validate_params
from mergeflow.models import build_from_spec, family_of
from mergeflow.params_reference import render
from tasks.stages import get_stage
from tasks.training import plan_finetune

params = validate_params({"model": {"arch": "tiny", "tiny": {"width": 5}}, "align": {"method": "weights"}})
assert params.model.family.name == "tiny" and params.section("model")["tiny"] == {"width": 5}
info = {"input_shape": [1, 8, 8], "num_classes": 10, "task": "classification"}
model, spec = family_of("tiny").build_base(params.section("model"), info, 10, seed=3)
assert spec["arch"] == "tiny" and spec["widths"] == [5]
trained = {key: value + 0.5 for key, value in model.state_dict().items()}
rebuilt = build_from_spec(spec)
rebuilt.load_state_dict(trained)
assert all(torch.equal(trained[key], value) for key, value in rebuilt.state_dict().items())
x = torch.randn(4, 1, 8, 8)
model.load_state_dict(trained)
assert torch.equal(model(x), rebuilt(x)) and rebuilt(x).shape == (4, 10)
assert "mergeflow.models.hf" not in sys.modules  # build_from_spec imports the family it needs, no other
model_permutation_spec(rebuilt, spec)  # alignment through the declared derivation
assert "### `model.tiny`" in render()  # docs/params.md, regenerated, documents its section
finetune = plan_finetune(params)[0].code
assert "mergeflow/models/tiny.py" in finetune and "mergeflow/objectives/regression.py" not in finetune
assert "mergeflow/models/tiny.py" in get_stage("finetune").code  # DVC's deps: every family's module
print("ok")
"""


def test_a_new_family_is_one_declaration_and_one_module(tmp_path):
    code = copy_code(tmp_path / "code")
    before = digests(code)
    families = code / "mergeflow/schema/families.py"
    families.write_text(families.read_text() + DECLARATION)
    (code / "mergeflow/models/tiny.py").write_text(MODULE)
    assert edited(before, digests(code)) == {"mergeflow/schema/families.py", "mergeflow/models/tiny.py"}

    run = run_on(code, textwrap.dedent(CHECK))
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
