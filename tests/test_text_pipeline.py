"""Transformers through the whole pipeline via the CLI: a tiny BERT and a tiny GPT-2 from config on a
topic CSV the test writes; caching, merges, federated rounds (IVON-ADMM included), MLflow, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fast_params, make_workspace, ran_steps, run_cli
from text_fixtures import write_topic_csv

from mergeflow.checkpoints import load_checkpoint, load_checkpoint_meta

pytestmark = pytest.mark.slow

TEXT = {"path": "csv", "text_column": "sentence", "label_column": "topic", "group_column": "genre"}
BERT = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 64}  # fmt: skip
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2}
ADAM = {"optimizer": "adam", "lr": 0.003}


def text_params(workspace, config: dict, **sections) -> dict:
    """Fast params for the topic CSV in ``workspace`` and a from-config transformer."""
    csv = write_topic_csv(workspace / "topics.csv")
    return fast_params(
        data={"source": "text", "text": {**TEXT, "data_files": str(csv)}, "tokenizer": {"vocab_size": 1000,
              "max_length": 24}},
        model={"arch": "transformers", "transformers": {"config": config}},
        pretrain={"epochs": 30, **ADAM},
        finetune={"epochs": 5, **ADAM},
        fisher={"kind": "empirical", "n_examples": 64, "batch_size": 32},
        **sections,
    )  # fmt: skip


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory, cli_env):
    path = tmp_path_factory.mktemp("text-bert")
    federated = {
        "algorithms": ["fedavg", "fedprox", "fedadmm", "bayes_admm"],
        "rounds": 2,
        "local": {"epochs": 1, **ADAM},
        # IVON's lr is the model's: the default 0.01 (chosen on digits MLPs) sends this Adam-pretrained
        # BERT to chance in round 1 (drift 18 against FedAvg's 0.9); 1e-3 keeps it at 1.0 (README)
        "options": {"bayes_admm": {"lr": 0.001}},
    }
    params = text_params(path, BERT, merge={"methods": ["average", "fisher", "task_arithmetic"]}, federated=federated)
    make_workspace(path, params)
    done = run_cli(["run"], path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Writing model shards" not in done.stderr  # transformers' progress bars stay off the console
    return path


def _metrics(path) -> dict:
    return json.loads((path / "metrics/evaluate.json").read_text())


def test_a_tiny_bert_trains_merges_and_federates_above_chance(bert_run):
    metrics = _metrics(bert_run)
    federated = [f"federated/{name}" for name in ("fedavg", "fedprox", "fedadmm", "bayes_admm")]
    for name in ("centralized", "merged/average", "merged/fisher", *federated):
        assert metrics[name]["accuracy"] > 0.9, (name, metrics[name])  # chance is 0.25
    by_group = metrics["merged/average"]["by_group"]  # the data's group column (genre)
    assert set(by_group) == {"forum", "news"} and all(g["accuracy"] > 0.8 for g in by_group.values())
    info = json.loads((bert_run / "data/prepared/info.json").read_text())
    assert info["modality"] == "text" and info["input_shape"] == [24]
    assert (bert_run / info["tokenizer"]["directory"] / "tokenizer.json").is_file()
    assert {"tokenize", "pretrain", "fisher/client_000", "merge/fisher"} <= ran_steps(bert_run)


def test_a_second_text_run_is_fully_cached(bert_run, cli_env):
    before = (bert_run / "models/merged/average.safetensors").read_bytes()
    done = run_cli(["run"], bert_run, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ran_steps(bert_run) <= {"track"}
    assert (bert_run / "models/merged/average.safetensors").read_bytes() == before


def test_the_merged_transformer_reloads_from_mlflow_and_classifies_text(bert_run):
    import mlflow

    from mergeflow.checkpoints import load_model

    mlflow.set_tracking_uri(f"sqlite:///{bert_run / 'mlflow.db'}")
    versions = mlflow.tracking.MlflowClient().search_model_versions("name='mergeflow.topics.average'")
    uri = f"models:/mergeflow.topics.average/{versions[0].version}"
    texts = ["the whale and the tiger", "rain and thunder in the cold fog", "bread cheese and soup"]
    assert list(mlflow.pyfunc.load_model(uri).predict(texts)["label"]) == ["animal", "weather", "food"]
    pipe = mlflow.transformers.load_model(uri)  # the same weights as the checkpoint
    encoded = pipe.tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    ours = load_model(bert_run / "models/merged/average.safetensors")(encoded["input_ids"])
    torch.testing.assert_close(pipe.model.eval()(**encoded).logits, ours, atol=1e-5, rtol=1e-5)
    run = mlflow.get_run(versions[0].run_id)
    assert {"test_accuracy", "test_news_accuracy", "test_forum_nll"} <= set(run.data.metrics)


def test_a_merged_transformer_reloads_with_from_pretrained_from_its_directory(bert_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from mergeflow.checkpoints import load_model

    directory = bert_run / "models/merged/fisher"
    reloaded = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    texts = ["the whale and the tiger", "rain and thunder in the cold fog"]
    encoded = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    ours = load_model(bert_run / "models/merged/fisher.safetensors")(encoded["input_ids"])
    torch.testing.assert_close(reloaded(**encoded).logits, ours, atol=1e-5, rtol=1e-5)
    animal, weather = (reloaded.config.id2label[int(i)] for i in reloaded(**encoded).logits.argmax(1))
    assert (animal, weather) == ("animal", "weather")


def test_export_lora_gives_a_peft_adapter_that_is_the_merged_model_at_full_rank(bert_run, cli_env):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from mergeflow.checkpoints import load_model

    too_large = run_cli(["export-lora", "fisher", "--rank", "100000"], bert_run, cli_env)
    assert too_large.returncode == 2 and "larger than module" in too_large.stderr
    assert not (bert_run / "models/adapters").exists() or not any((bert_run / "models/adapters").iterdir())
    done = run_cli(["export-lora", "fisher", "--energy", "1"], bert_run, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = bert_run / "models/adapters/fisher"
    base = AutoModelForSequenceClassification.from_pretrained(out / "base")
    adapted = PeftModel.from_pretrained(base, out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "base")
    encoded = tokenizer(["the whale and the tiger", "bread cheese and soup"], padding=True, return_tensors="pt")
    ours = load_model(bert_run / "models/merged/fisher.safetensors")(encoded["input_ids"])
    with torch.no_grad():
        torch.testing.assert_close(adapted(**encoded).logits, ours, atol=1e-4, rtol=1e-4)
    assert json.loads((out / "adapter_config.json").read_text())["rank_pattern"]  # a rank per module


def test_a_tiny_gpt2_pretrained_as_a_language_model_and_fine_tuned_with_lora_runs_through_the_pipeline(
    tmp_path, cli_env
):
    from safetensors.torch import load_file

    from tasks.layout import global_checkpoint, message_file

    lora = {"r": 4, "alpha": 8, "target_modules": ["c_attn"]}
    federated = {"algorithms": ["fedavg"], "rounds": 2, "exchange": "adapters", "local": {"epochs": 2, **ADAM}}
    params = text_params(tmp_path, GPT2, merge={"methods": ["average"]}, federated=federated)
    params["finetune"] |= {"lora": lora, "lr": 0.01}
    params["pretrain"]["language_model"] = {"epochs": 2, "lr": 0.001, "text": "train"}  # next-token LM first
    make_workspace(tmp_path, params | {"tracking": {"log_models": False}})
    done = run_cli(["run"], tmp_path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = _metrics(tmp_path)
    assert metrics["centralized"]["accuracy"] > 0.9 and metrics["merged/average"]["accuracy"] > 0.8
    lm_losses = load_checkpoint_meta(tmp_path / "models/base/base.safetensors")["language_model_losses"]
    assert len(lm_losses) == 2 and lm_losses[1] < lm_losses[0]
    # federated.exchange: adapters: clients send the LoRA factors and the head, nothing of the body
    message = load_file(tmp_path / message_file("fedavg", 2, 0))
    assert message and all("lora_" in key or ".score." in key for key in message), sorted(message)[:5]
    assert metrics["federated/fedavg"]["accuracy"] > 0.9, metrics["federated/fedavg"]
    base = load_checkpoint(tmp_path / "models/base/base.safetensors")[0]
    final = load_checkpoint(tmp_path / global_checkpoint("fedavg", 2))[0]
    assert set(final) == set(base)
    for key, value in base.items():  # the global model is the base model plus B̄·Ā on the targets, and its head
        assert torch.equal(final[key], value) == ("c_attn.weight" not in key and ".score." not in key), key


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"data": {"text": {"text_column": "body"}}}, "data.text.text_column: no column 'body' in the table"),
        ({"data": {"text": {"label_column": "subject"}}}, "data.text.label_column: no column 'subject' in the table"),
        ({"data": {"text": {"group_column": "site"}}}, "data.text.group_column: no column 'site' in the table"),
        (
            {"model": {"transformers": {"config": {**BERT, "vocab_size": 200}}}},
            "model.transformers.config.vocab_size: 200 embeddings",
        ),
        (
            {"model": {"transformers": {"pretrained": "./no-such-model"}}},
            "model.transformers.pretrained: ./no-such-model is not",
        ),
        ({"model": {"transformers": {"pretrained": "someone/a-model"}}}, "cannot be downloaded"),
        (
            {"model": {"transformers": {"config": {**BERT, "model_type": "roberta"}}}, "align": {"method": "weights"}},
            "align.method: transformers model_type 'roberta' has no permutation spec",
        ),
        ({"align": {"method": "weights", "repair": True}}, "align.repair: REPAIR is implemented for MLP/CNN"),
        ({"data": {"tokenizer": {"max_length": 0}}}, "data.tokenizer.max_length"),
        ({"data": {"source": "wordnet", "wordnet": {"root": "./nowhere"}}}, "apt-get install wordnet-base"),
        ({"finetune": {"lora": {"target_modules": ["q_proj"]}}}, "finetune.lora.target_modules: ['q_proj'] match no"),
        (
            {"model": {"transformers": {"task": "causal_lm"}}},
            "causal_lm needs a decoder (gpt2, llama, …); config.model_type is",
        ),
        (
            {"model": {"transformers": {"task": "causal_lm", "config": GPT2}}, "fisher": {"kind": "exact"}},
            "fisher.kind: 'exact'",
        ),
    ],
)
def test_bad_text_input_is_one_clear_line_and_writes_nothing(tmp_path, cli_env, change, message):
    params = text_params(tmp_path, BERT)
    for section, values in change.items():
        for key, value in values.items():
            params[section][key] = {**(params[section].get(key) or {}), **value} if isinstance(value, dict) else value
    _refused(tmp_path, params, cli_env, message)


def _refused(path, params: dict, env: dict, message: str) -> None:
    """``mergeflow run`` exits 2 with one error line holding ``message`` and writes no data or model."""
    make_workspace(path, params)
    done = run_cli(["run"], path, env)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("mergeflow: error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr[-2000:]
    assert not (path / "data").exists() and not (path / "models").exists()


def test_a_pretrained_tokenizer_larger_than_the_models_embeddings_is_refused_before_any_work(tmp_path, cli_env):
    from transformers import BertConfig, BertModel

    from mergeflow.data.tokenize import train_tokenizer

    model_dir = tmp_path / "small-vocab-bert"
    BertModel(BertConfig(vocab_size=120, **{k: v for k, v in BERT.items() if k != "model_type"})).save_pretrained(
        model_dir
    )
    sentences = write_topic_csv(tmp_path / "corpus.csv").read_text().splitlines()
    train_tokenizer(sentences, vocab_size=400, min_frequency=1).save_pretrained(model_dir)
    params = text_params(tmp_path, BERT)
    params["model"]["transformers"] = {"pretrained": str(model_dir)}
    _refused(tmp_path, params, cli_env, "small-vocab-bert: the tokenizer has")
    checked = run_cli(["validate"], tmp_path, cli_env)
    assert checked.returncode == 2 and "small-vocab-bert: the tokenizer has 4" in checked.stderr, checked.stderr


def test_a_hub_name_the_hub_cannot_serve_is_refused_without_hf_hub_offline(tmp_path, cli_env):
    env = {**cli_env, "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens on the discard port
    env.pop("HF_HUB_OFFLINE")
    params = text_params(tmp_path, BERT)
    params["model"]["transformers"] = {"pretrained": "someone/a-model"}
    _refused(tmp_path, params, env, "'someone/a-model' is not a local directory, and it cannot be downloaded (no conn")


def test_a_tiny_gpt2_causal_lm_trains_merges_federates_and_reloads_below_the_unigram_baseline(tmp_path, cli_env):
    import mlflow
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergeflow.checkpoints import load_model

    params = text_params(
        tmp_path,
        GPT2,
        merge={"methods": ["average", "fisher", "regmean", "exact"]},
        federated={"algorithms": ["fedavg"], "rounds": 2, "local": {"epochs": 1, **ADAM}},
    )
    params["model"]["transformers"]["task"] = "causal_lm"
    params["fisher"] |= {"low_rank": True, "factor_memory_mb": 1}  # a sketch of every example's scores in 1 MiB
    params["pretrain"]["epochs"] = 10
    params["data"]["tokenizer"]["vocab_size"] = 300  # word pieces: the topic of a text predicts its later pieces
    make_workspace(tmp_path, params)
    done = run_cli(["run"], tmp_path, cli_env)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = _metrics(tmp_path)
    baseline = metrics["sanity"]["baseline_nll"]  # the training unigram distribution's test token NLL
    assert metrics["sanity"]["warning"] is None and "ensemble" not in metrics
    assert metrics["centralized"]["nll"] < 0.9 * baseline, (metrics["centralized"], baseline)
    for name in ("merged/average", "merged/fisher", "merged/regmean", "federated/fedavg"):
        assert metrics[name]["nll"] < 0.97 * baseline, (name, metrics[name], baseline)
        assert metrics[name]["perplexity"] < metrics["base"]["perplexity"], name
    assert set(metrics["merged/average"]["by_group"]) == {"forum", "news"}
    factors = load_file(tmp_path / "models/fishers/client_000.factors.safetensors")["U"]
    assert 1 <= len(factors) and 3 * len(factors) * factors.shape[1] * 4 <= 2**20
    assert metrics["merged/exact"]["nll"] < 0.97 * baseline  # on the sketched factors, the prior centred at the base
    directory = tmp_path / "models/merged/fisher"
    reloaded = AutoModelForCausalLM.from_pretrained(directory).eval()
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
    encoded = AutoTokenizer.from_pretrained(directory)(["the whale and the tiger"], return_tensors="pt")
    ours = load_model(tmp_path / "models/merged/fisher.safetensors")(encoded["input_ids"])
    torch.testing.assert_close(reloaded(**encoded).logits, ours, atol=1e-5, rtol=1e-5)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    versions = mlflow.tracking.MlflowClient().search_model_versions("name='mergeflow.topics.fisher'")
    pipe = mlflow.transformers.load_model(f"models:/mergeflow.topics.fisher/{versions[0].version}")
    torch.testing.assert_close(pipe.model.eval()(**encoded).logits, ours, atol=1e-5, rtol=1e-5)
    run = mlflow.get_run(versions[0].run_id)
    assert {"test_perplexity", "test_nll", "test_news_perplexity"} <= set(run.data.metrics)
