"""Federated learning algorithms (FedAvg, FedProx, FedADMM, Bayes-ADMM/IVON-ADMM) as pure functions.

Each algorithm is declared in ``mergeflow.schema.federated`` (:data:`ALGORITHMS`, torch-free) and
implemented by a class in its own module here, which :func:`get_algorithm` imports when asked for that
algorithm, and no other. An algorithm has ``init_server``, ``init_client``, ``client_update``,
``server_update``, ``global_state`` (and ``exact_client_update`` for quadratic losses); every state and
message is a ``dict[str, torch.Tensor]``. :func:`run_rounds` is the plain round loop; :mod:`.quadratic`
the exactly solvable client path. No Prefect or MLflow here.
"""

from mergeflow.federated.base import (
    ClientData,
    ClientState,
    FederatedAlgorithm,
    LocalTraining,
    Message,
    ServerState,
    client_drift,
    client_generator,
    get_algorithm,
    load_parameters,
    model_parameters,
    register_algorithm,
    sample_participants,
)
from mergeflow.federated.heads import LocalHeads
from mergeflow.federated.loop import FederatedRun, run_rounds
from mergeflow.federated.quadratic import exact_posterior, run_quadratic_rounds
from mergeflow.federated.quadratic_loss import QuadraticProblem, linear_gaussian_problem, scalar_problem
from mergeflow.schema.federated import ALGORITHMS, Algorithm, validate_options

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "ClientData",
    "ClientState",
    "FederatedAlgorithm",
    "FederatedRun",
    "LocalHeads",
    "LocalTraining",
    "Message",
    "QuadraticProblem",
    "ServerState",
    "client_drift",
    "client_generator",
    "exact_posterior",
    "get_algorithm",
    "linear_gaussian_problem",
    "load_parameters",
    "model_parameters",
    "register_algorithm",
    "run_quadratic_rounds",
    "run_rounds",
    "sample_participants",
    "scalar_problem",
    "validate_options",
]
