"""What a pipeline's MLflow runs say: the data's name, the params in use, a run name that tells runs apart, and
registered models that never mix input signatures."""

from __future__ import annotations

import pytest

from mergeflow.config import apply_overrides, validate_params
from tasks.mlflow_logging import flatten
from tasks.tracking_params import data_label, params_in_use, run_name

TABLE = ["data.source=table", "data.table.path=csv"]


@pytest.mark.parametrize(
    ("overrides", "label"),
    [
        ([], "digits"),
        (["data.source=wine"], "wine"),
        ([*TABLE, "data.table.data_files=/d/iris.csv"], "iris"),
        ([*TABLE, "data.table.data_files=/d/iris/train.csv"], "iris"),  # a split's file: its folder names the data
        ([*TABLE, "data.table.data_files=/d/iris/*.csv"], "iris"),
        ([*TABLE, "data.table.data_files={train: /x/wine quality.csv}"], "wine_quality"),
        (["data.source=table", "data.table.path=glue", "data.table.name=sst2"], "glue-sst2"),
        ([*TABLE, "data.table.data_files=/d/***.csv"], "d"),
    ],
)
def test_the_data_label_names_the_data(overrides, label):
    assert data_label(validate_params(apply_overrides({}, overrides))) == label


def test_the_params_in_use_leave_out_other_sources_unrun_options_and_unset_values():
    params = validate_params(
        apply_overrides(
            {}, ["data.source=pinwheel", "merge.methods=[average, ties]", "federated.algorithms=[fedprox]", "seed=3"]
        )
    )
    used = params_in_use(params)
    assert "pinwheel" in used["data"] and not {"linreg", "table", "text", "wordnet", "tokenizer"} & set(used["data"])
    assert "transformers" not in used["model"] and "orchestration" not in used
    assert set(used["merge"].get("options", {})) <= {"average", "ties"}
    assert set(used["federated"].get("options", {})) <= {"fedprox"}
    assert "lora" not in used["finetune"] and "clients" not in used["finetune"]  # null and {}: unset
    assert used["seed"] == 3


def _flat(*overrides: str) -> dict[str, str]:
    return flatten(params_in_use(validate_params(apply_overrides({}, list(overrides)))))


def test_a_run_is_named_by_its_data_and_what_changed_since_the_last_run_on_it():
    before = _flat("merge.methods=[average, task_arithmetic]", "federated.algorithms=[fedavg]")
    assert run_name("digits", before, None) == "digits"  # the first run on the data
    assert run_name("digits", before, before) == "digits"
    scaled = _flat("merge.methods=[average, task_arithmetic]", "federated.algorithms=[fedavg]",
                   "merge.options.task_arithmetic.scaling=0.5")  # fmt: skip
    assert run_name("digits", scaled, before) == "digits task_arithmetic.scaling=0.5"
    # A new merge's options come with the methods list; an emptied list and a dropped setting are named.
    more = _flat("merge.methods=[average, task_arithmetic, ties]", "federated.algorithms=[]")
    assert (
        run_name("digits", more, before)
        == "digits merge.methods=[average,task_arithmetic,ties] federated.algorithms=[]"
    )
    clients = _flat("merge.methods=[average, task_arithmetic]", "federated.algorithms=[fedavg]",
                    "finetune.clients={1: {lr: 0.1}}")  # fmt: skip
    assert run_name("digits", clients, before) == "digits clients.1.lr=0.1"
    assert run_name("digits", before, clients) == "digits clients.1.lr=unset"
    many = _flat("seed=1", "finetune.lr=0.1", "finetune.epochs=3", "pretrain.epochs=2", "partition.alpha=2")
    assert run_name("digits", many, _flat()).endswith("+1 more")


def test_a_model_of_another_signature_is_not_registered_as_a_new_version(tmp_path):
    import mlflow

    from tasks.model_registry import register

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    source = (tmp_path / "model").as_uri()
    first, refused = register(
        mlflow, source, "e.iris.average", {"mergeflow.checkpoint_sha256": "a", "mergeflow.signature": "s1"}
    )
    assert first == "e.iris.average version 1" and refused is None
    again, refused = register(
        mlflow, source, "e.iris.average", {"mergeflow.checkpoint_sha256": "a", "mergeflow.signature": "s1"}
    )
    assert again is None and refused is None  # the same checkpoint: no new version
    other, refused = register(
        mlflow, source, "e.iris.average", {"mergeflow.checkpoint_sha256": "b", "mergeflow.signature": "s2"}
    )
    assert other is None and refused.startswith("e.iris.average: its versions take other inputs")
    assert len(mlflow.tracking.MlflowClient().search_model_versions("name='e.iris.average'")) == 1
