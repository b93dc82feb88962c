"""How a merged model is logged to MLflow: in the flavour its family declares (:data:`FLAVOURS`), with two raw
rows as its input example, once per checkpoint. ``mlflow`` is passed in; torch is imported only to log a
model."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from mergeflow.checkpoints import load_checkpoint_meta
from tasks.layout import PREPARED, merged_pretrained_dir


def input_example(root: Path, info: dict[str, Any], prepared: str = PREPARED):
    """Two raw rows as a logged model takes them: a DataFrame of the source's columns, or an array of
    features (a built-in source's, or token ids for text), from ``prepared`` (a task's prepared data)."""
    import numpy as np
    import pandas as pd

    from tasks.prepared import read_arrays

    raw = info.get("raw_example")
    if raw is None or list(raw) == ["x"]:
        features = read_arrays(root / prepared / "test.parquet", info)[0][:2]
        return features.reshape(len(features), -1).astype(np.float64)
    frame = pd.DataFrame(raw)
    numbers = frame.select_dtypes("number").columns  # as doubles, so that whole-number columns also take 1.5 or NaN
    return frame.astype({column: np.float64 for column in numbers})


def logged_model_uri(mlflow: Any, experiment_id: str, name: str, digest: str) -> str | None:
    """The URI of the model this experiment already logged for merge ``name`` from the checkpoint ``digest``, in
    full (a logging that a kill stopped half-way leaves a model that is not READY: it is logged again)."""
    from mlflow.entities import LoggedModelStatus

    logged = mlflow.search_logged_models(experiment_ids=[experiment_id], output_format="list")
    same = [m for m in logged if m.name == name and m.tags.get("mergeflow.checkpoint_sha256") == digest]
    ready = [m for m in same if m.status == LoggedModelStatus.READY]
    return ready[0].model_uri if ready else None


def log_model(mlflow: Any, root: Path, name: str, path: Path, example, tags: dict[str, str]):
    """Log a merged model in its family's flavour (:data:`FLAVOURS`), named after its merge, with ``tags``."""
    import torch

    from mergeflow.schema.families import family_of_arch

    requirements = [f"torch=={torch.__version__.split('+')[0]}"]
    flavour = family_of_arch(load_checkpoint_meta(path)["spec"]["arch"]).flavour
    return FLAVOURS[flavour](mlflow, root, name, path, example, requirements, tags)


def _log_pipeline(mlflow, root: Path, name: str, path: Path, example, requirements: list[str], tags: dict[str, str]):
    """A transformer as a text-classification or text-generation pipeline (text in, labels or text out),
    from the directory its family exported beside the checkpoint."""
    import mlflow.transformers
    import transformers

    directory = root / merged_pretrained_dir(name)
    config = transformers.AutoConfig.from_pretrained(directory)
    generates = any(arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel") for arch in config.architectures or [])
    auto = transformers.AutoModelForCausalLM if generates else transformers.AutoModelForSequenceClassification
    model = auto.from_pretrained(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    task = "text-generation" if generates else "text-classification"
    pipe = transformers.pipeline(task, model=model, tokenizer=tokenizer, truncation=True)
    # Explicit requirements: the flavour would otherwise infer torchvision, which offline installs lack.
    requirements.append(f"transformers=={transformers.__version__}")
    return mlflow.transformers.log_model(transformers_model=pipe, name=name, pip_requirements=requirements, tags=tags)


def _log_raw_rows_model(
    mlflow, root: Path, name: str, path: Path, example, requirements: list[str], tags: dict[str, str]
):
    """A pyfunc model that takes the user's raw rows: the feature encoding fitted on the training split
    (standardisation, one-hot categories, filled gaps) travels with the checkpoint, and mergeflow's code
    with the model, so ``mlflow.pyfunc.load_model(uri).predict(rows)`` works wherever torch is installed."""
    import mlflow.pyfunc
    import pandas
    import pyarrow

    from tasks.serving import CHECKPOINT, INFO
    from tasks.steps import project_root_of_code

    code = project_root_of_code()
    requirements += [f"pandas=={pandas.__version__}", f"pyarrow=={pyarrow.__version__}"]
    info_file = root / PREPARED / "info.json"
    return mlflow.pyfunc.log_model(
        name=name,
        tags=tags,
        python_model=str(code / "tasks" / "pyfunc_model.py"),
        artifacts={CHECKPOINT: str(path), INFO: str(info_file)},
        code_paths=[str(code / "mergeflow"), str(code / "tasks")],
        input_example=example,
        signature=_raw_rows_signature(path, info_file, example),
        pip_requirements=requirements,
    )


def _raw_rows_signature(path: Path, info_file: Path, example):
    """The model's signature: the columns it answers with, and the raw columns it takes (doubles for numbers,
    so whole numbers and gaps pass). Built-in sources take arrays of any float type: no input schema, since
    MLflow's tensor specs would refuse every dtype but one."""
    import pandas
    from mlflow.models import infer_signature

    from mergeflow.predictor import TablePredictor

    outputs = TablePredictor.from_files(path, info_file).predict(example)
    with warnings.catch_warnings():  # its hint on integer columns concerns inputs; a label column has no gaps
        warnings.filterwarnings("ignore", message=".*Inferred schema contains integer column")
        return infer_signature(example if isinstance(example, pandas.DataFrame) else None, outputs)


FLAVOURS = {"transformers": _log_pipeline, "pyfunc": _log_raw_rows_model}  # by a family's declared flavour
