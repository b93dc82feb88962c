"""Adding a merge method is one declaration plus one implementation module: shown on a copy of the code tree."""

from __future__ import annotations

from code_copies import copy_code, digests, edited, run_on
from conftest import ROOT

DECLARATION = 'declare(MergeMethod("median", "mergeflow.merge.median:median", elementwise=True))\n'
IMPLEMENTATION = '''"""The elementwise median of the clients' tensors."""

import torch

from mergeflow.merge.engine import TensorInputs


def median(x: TensorInputs, options: object) -> torch.Tensor:
    """Elementwise median of the K clients' tensors (the lower of the middle two for an even K)."""
    return torch.stack(x.tensors).median(dim=0).values
'''

# Run on the copy: params validate without importing the method's code, and the merge runs it.
CHECK = """
import sys
import torch
from mergeflow.config import validate_params
from mergeflow.errors import ConfigError
from mergeflow.merge import merge
from tasks.stages import get_stage
from tasks.merging import plan_merge

params = validate_params({"merge": {"methods": ["average", "median"]}})
assert "mergeflow.merge.median" not in sys.modules
try:
    validate_params({"merge": {"methods": ["median"], "options": {"median": {"bogus": 1}}}})
    raise AssertionError("an unknown option of the new method passed")
except ConfigError as error:
    assert "median" in str(error) and "bogus" in str(error), error
[median] = [step for wave in plan_merge(params) for step in wave if step.name == "merge/median"]
assert median.members[0] == "mergeflow.merge.median" and "mergeflow/merge/median.py" in median.code
assert "mergeflow/merge/median.py" in get_stage("merge").code  # dvc.yaml's deps, once regenerated
states = [{"w": torch.tensor([1.0, 9.0])}, {"w": torch.tensor([5.0, 2.0])}, {"w": torch.tensor([3.0, 4.0])}]
assert merge("median", states)["w"].tolist() == [3.0, 4.0]
"""


def test_a_new_method_is_one_declaration_line_and_one_module(tmp_path):
    code = copy_code(tmp_path / "code")
    before = digests(code)
    declarations = code / "mergeflow/schema/merge.py"
    declarations.write_text(declarations.read_text() + DECLARATION)
    (code / "mergeflow/merge/median.py").write_text(IMPLEMENTATION)
    assert edited(before, digests(code)) == {"mergeflow/schema/merge.py", "mergeflow/merge/median.py"}

    done = run_on(code, CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (ROOT / "mergeflow/merge/median.py").exists()  # the checkout is untouched
