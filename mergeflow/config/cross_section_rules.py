"""The rules between sections (a value one section allows that another rules out), checked once every section
is valid on its own."""

from __future__ import annotations

from mergeflow.config.data_sections import DataConfig
from mergeflow.config.params import Params
from mergeflow.config.tasks_rules import check_tasks
from mergeflow.schema.federated import participants_per_round


def check_cross_section_rules(params: Params) -> None:
    """Raise ``ValueError`` (its message ``key: problem``) for the first rule between sections that ``params`` break."""
    check_tasks(params)
    for key, clients in (("clients", params.finetune.clients), ("checkpoints", params.finetune.checkpoints)):
        for cid in clients:
            if not 0 <= cid < params.num_clients:
                raise ValueError(
                    f"finetune.{key}.{cid}: no such client (partition.num_clients is {params.partition.num_clients})"
                )
    reference = params.align.reference
    if isinstance(reference, int) and not 0 <= reference < params.num_clients:
        raise ValueError(
            f"align.reference: no client {reference} (partition.num_clients is {params.partition.num_clients})"
        )
    if params.partition.method == "natural" and not params.data.group_column:
        where = f"data.{params.data.source}.group_column"
        raise ValueError(f"partition.method: 'natural' needs a group column; set {where}")
    regression = params.data.task == "regression"
    _check_federated(params)
    _check_objective(params)
    _check_family(params)
    if regression and params.partition.method in ("dirichlet", "pathological"):
        raise ValueError(
            f"partition.method: {params.partition.method!r} skews class labels, and the data is a regression "
            "task; use iid, natural or replicated"
        )
    if params.federated.exchange == "adapters" and params.finetune.lora is None:
        raise ValueError("federated.exchange: 'adapters' exchanges LoRA adapters; set finetune.lora (r, alpha, …)")
    if params.pretrain.enabled and params.data.server_fraction == 0:
        raise ValueError(
            "pretrain.enabled: pre-training needs a server split; set data.server_fraction > 0 "
            "or pretrain.enabled: false for a shared random init"
        )
    if params.centralized.keep == "best_validation" and params.data.validation_fraction == 0:
        raise ValueError(
            "centralized.keep: best_validation chooses the epoch on the validation split; "
            "set data.validation_fraction > 0"
        )
    language_model = params.pretrain.language_model
    if language_model and language_model.text == "corpus":
        if params.data.declaration.corpus_size(params.data.options) == 0:
            raise ValueError(
                "pretrain.language_model.text: corpus needs a source with an unlabelled corpus "
                f"(e.g. data.wordnet.corpus_examples > 0), and data.source {params.data.source!r} gives none"
            )
    if params.centralized.keep == "best_validation" and params.finetune.lora:
        raise ValueError("centralized.keep: best_validation does not support finetune.lora yet; use keep: last")
    from mergeflow.schema.merge import DECLARED

    for name in params.merge.methods:
        method, searched = params.merge.method_of(name), params.merge.searched(name)
        if "scorer" in DECLARED[method].needs and params.data.validation_fraction == 0:
            raise ValueError(
                f"merge.methods: {name!r} chooses on the validation split; set data.validation_fraction > 0"
            )
        if searched and params.data.validation_fraction == 0:
            raise ValueError(
                f"merge.options.{name}.{searched[0]}: a list is a search, chosen on the validation split; "
                "set data.validation_fraction > 0"
            )
        count_problem = DECLARED[method].model_count_problem(params.num_clients)
        if count_problem:
            raise ValueError(
                f"merge.methods: {name!r} ({method}) {count_problem}, and partition.num_clients is "
                f"{params.partition.num_clients}"
            )
        if "factors" in DECLARED[method].needs and not params.fisher.low_rank:
            raise ValueError(f"fisher.low_rank: merge method {name!r} needs Fisher factors; set it to true")
    rows = _known_training_rows(params.data)
    split = params.partition.splits_rows
    if rows is not None and not params.multitask and split and params.partition.num_clients > rows:
        raise ValueError(
            f"partition.num_clients: {params.partition.num_clients} clients but only {rows} training samples"
        )


def _check_federated(params: Params) -> None:
    """Server optimizers, aggregators, attacks and DP: what each entry's maths allows, and sizes."""
    from mergeflow.schema.federated import ALGORITHMS

    federated, clients = params.federated, params.num_clients
    attack, dp = federated.attack, federated.dp
    if attack is not None and attack.clients > clients:
        raise ValueError(f"federated.attack.clients: {attack.clients} attackers but partition.num_clients is {clients}")
    if attack is not None and attack.poisons_data and params.objective != "classification":
        raise ValueError(f"federated.attack.kind: label_flip flips class labels, and the task is {params.objective}")
    n = participants_per_round(clients, federated.fraction)
    for name in federated.algorithms:
        algorithm = federated.algorithm_of(name)
        declared = ALGORITHMS[algorithm]
        server, aggregator = federated.server_for(name), federated.aggregator_for(name)
        if not server.is_identity and not declared.point_estimate:
            raise ValueError(
                f"federated.server: {name!r} ({algorithm}) has no point-estimate global model to step on "
                "(its server step is in natural parameters); use optimizer: sgd, lr: 1"
            )
        averages = declared.averages_messages
        if not aggregator.is_identity and not averages:
            raise ValueError(
                f"federated.aggregator: {name!r} ({algorithm}) does not average the clients' messages "
                "(its server step sums duals or natural parameters); use name: mean"
            )
        if dp is not None and not averages:
            raise ValueError(f"federated.dp: DP-FedAvg replaces an averaging server step; {name!r} is {algorithm}")
        if dp is not None and not aggregator.is_identity:
            raise ValueError(f"federated.aggregator: {name!r}: DP-FedAvg's noised sum needs name: mean")
        if problem := aggregator.check_participants(n):
            raise ValueError(problem)
    if dp is not None:
        from mergeflow.accounting import check_dp

        if problem := check_dp(dp, clients, federated.fraction, federated.rounds):
            raise ValueError(problem)


def _check_objective(params: Params) -> None:
    """The objective's own rules: the metrics it selects on, its Fisher kinds, language-model pre-training."""
    from mergeflow.schema.objectives import declared_objective

    name = params.objective
    objective = declared_objective(name)
    if params.merge.select_by not in ("auto", *objective.select_by):
        raise ValueError(
            f"merge.select_by: {params.merge.select_by} does not apply to a {name} task; "
            f"use {' or '.join(objective.select_by)}"
        )
    if params.fisher.kind not in objective.fisher_kinds:
        raise ValueError(
            f"fisher.kind: {params.fisher.kind!r} is not a Fisher of a {name} task (for a causal LM, 'exact' "
            f"would sum over every vocabulary token at every position); use {' or '.join(objective.fisher_kinds)}"
        )
    if objective.trains_language_model and params.pretrain.language_model is not None:
        raise ValueError(
            f"pretrain.language_model: with a {name} task the pretrain step already trains the "
            "language model on the server split; remove it"
        )


def _check_family(params: Params) -> None:
    """What the model family supports: its inputs, alignment, BackPACK, language models, its own rules."""
    family = params.model.family
    if not params.multitask and (family.inputs == "tokens") != params.data.is_text:  # each task's: tasks_rules
        raise ValueError(
            f"model.arch: {params.model.arch!r} takes {family.inputs}, and data.source {params.data.source!r} "
            f"{'is' if params.data.is_text else 'is not'} text; text sources need model.arch: transformers"
        )
    if not family.aligns and params.align.method != "none":
        raise ValueError(
            f"align.method: permutation alignment of {family.name} models is not implemented; set it to none"
        )
    if params.align.repair and params.align.method == "none":
        raise ValueError("align.repair: REPAIR rescales aligned models; set align.method to weights or activations")
    if params.align.repair and not family.repairs:
        raise ValueError(f"align.repair: REPAIR is implemented for MLP/CNN models, not {family.name} models")
    if not family.backpack and params.fisher.backend == "backpack":
        raise ValueError(f"fisher.backend: BackPACK does not cover {family.name} modules; use auto or functorch")
    if not family.language_models and params.pretrain.language_model is not None:
        raise ValueError("pretrain.language_model: language-model pre-training needs model.arch: transformers")
    if not family.language_models and params.finetune.lora is not None:
        raise ValueError("finetune.lora: LoRA needs a transformers model (model.arch: transformers)")
    family.check(params)


def _known_training_rows(data: DataConfig) -> int | None:
    total = data.declaration.known_rows(data.options)
    if total is None:
        return None
    return int(total * (1 - data.test_fraction - data.server_fraction - data.validation_fraction))
