"""Adding a federated algorithm is one declaration plus one implementation module: shown on a copy of the code tree."""

from __future__ import annotations

from code_copies import copy_code, digests, edited, run_on
from conftest import ROOT

DECLARATION = '''

class FedAvgStepOptions(FedAvgOptions):
    """``step`` η: the server moves θ̄ by η times its way to the participants' average."""

    step: float = Field(0.5, gt=0.0, le=1.0)


ALGORITHMS.declare(
    Algorithm(
        "fedavg_step",
        "mergeflow.federated.fedavg_step:FedAvgStep",
        FedAvgStepOptions,
        averages_messages=True,
        point_estimate=True,
    )
)
'''
IMPLEMENTATION = '''"""FedAvg with a server step: the global model moves part of the way to the clients' average."""

from mergeflow.federated.base import MEAN
from mergeflow.federated.fedavg import FedAvg


class FedAvgStep(FedAvg):
    """FedAvg with a server step η: θ̄ ← θ̄ + η(Σ_k w_k θ_k − θ̄)."""

    def server_update(self, server, messages, sizes, num_clients, options):
        """FedAvg's average, then θ̄ moved η of the way to it."""
        average = super().server_update(server, messages, sizes, num_clients, options)
        means = [key for key in server if key.startswith(MEAN)]
        return {**average, **{key: server[key] + options.step * (average[key] - server[key]) for key in means}}
'''

# Run on the copy: params validate without importing the algorithm's code, its steps are keyed by its module, and
# the plain round loop runs it.
CHECK = """
import sys
import torch
from mergeflow.config import validate_params
from mergeflow.errors import ConfigError
from mergeflow.federated import ClientData, LocalTraining, run_rounds
from mergeflow.models.sequential import build_model
from tasks.stages import get_stage
from tasks.federated import plan_federated

federated = {"algorithms": ["fedavg", "fedavg_step"], "options": {"fedavg_step": {"step": 0.25}}}
params = validate_params({"federated": federated})
assert "mergeflow.federated.fedavg_step" not in sys.modules
try:
    validate_params({"federated": {"algorithms": ["fedavg_step"], "options": {"fedavg_step": {"step": 2}}}})
    raise AssertionError("an invalid option of the new algorithm passed")
except ConfigError as error:
    assert "options.fedavg_step.step" in str(error), error
steps = [step for wave in plan_federated(params) for step in wave if step.name.startswith("federated/fedavg_step/")]
assert steps and all(step.members[0] == "mergeflow.federated.fedavg_step" for step in steps)
assert all("mergeflow/federated/fedavg_step.py" in step.code for step in steps)
assert "mergeflow/federated/fedavg_step.py" in get_stage("federated").code  # dvc.yaml's deps, once regenerated

generator = torch.Generator().manual_seed(0)
clients = [ClientData(torch.randn(40, 4, generator=generator), torch.randint(0, 3, (40,), generator=generator))
           for _ in range(3)]

def run(algorithm, **options):
    model, train = lambda: build_model("linear", [4], 3, seed=0), LocalTraining(epochs=1, lr=0.1, batch_size=20)
    return run_rounds(algorithm, model, clients, 2, options=options, train=train)

full, plain = run("fedavg_step", step=1.0).global_state, run("fedavg").global_state
assert all(torch.allclose(full[name], plain[name], rtol=0, atol=1e-12) for name in plain)  # the whole way: FedAvg
half = run("fedavg_step", step=0.5).global_state
assert not any(torch.allclose(half[name], plain[name]) for name in plain)
"""


def test_a_new_algorithm_is_one_declaration_and_one_module(tmp_path):
    code = copy_code(tmp_path / "code")
    before = digests(code)
    declarations = code / "mergeflow/schema/federated.py"
    declarations.write_text(declarations.read_text() + DECLARATION)
    (code / "mergeflow/federated/fedavg_step.py").write_text(IMPLEMENTATION)
    assert edited(before, digests(code)) == {"mergeflow/schema/federated.py", "mergeflow/federated/fedavg_step.py"}

    done = run_on(code, CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (ROOT / "mergeflow/federated/fedavg_step.py").exists()  # the checkout is untouched
