"""The params schema: ``params.yaml`` validated before any work, plus ``-S key=value`` overrides.

Every section is a pydantic model with ``extra="forbid"``, so a misspelt key is an error that names it.
Stages read whole sections; their names double as DVC ``params:`` entries. This package's modules: the
sections (``*_section(s).py``), the whole file (``params.py``), the rules between sections
(``cross_section_rules.py``), ``-S`` overrides (``overrides.py``), problems as lines (``error_lines.py``) and
reading and validating (``loading.py``). Import from here: the modules are the package's inside.
"""

from mergeflow.config.analysis_sections import AlignConfig, EvaluateConfig, FisherConfig
from mergeflow.config.data_sections import DataConfig, PartitionConfig, TokenizerConfig
from mergeflow.config.federated_section import FederatedConfig
from mergeflow.config.loading import load_params, validate_params
from mergeflow.config.merge_section import MergeConfig
from mergeflow.config.model_section import ModelConfig
from mergeflow.config.overrides import apply_overrides, parse_override
from mergeflow.config.params import Params
from mergeflow.config.run_sections import OrchestrationConfig, TrackingConfig
from mergeflow.config.tasks_rules import federated_heads
from mergeflow.config.training_sections import (
    CentralizedConfig,
    FinetuneConfig,
    LanguageModelPretraining,
    LocalTrainConfig,
    LoraSettings,
    PretrainConfig,
    TrainConfig,
    TrainOverride,
)

__all__ = [
    "AlignConfig",
    "CentralizedConfig",
    "DataConfig",
    "EvaluateConfig",
    "FederatedConfig",
    "FinetuneConfig",
    "FisherConfig",
    "LanguageModelPretraining",
    "LocalTrainConfig",
    "LoraSettings",
    "MergeConfig",
    "ModelConfig",
    "OrchestrationConfig",
    "Params",
    "PartitionConfig",
    "PretrainConfig",
    "TokenizerConfig",
    "TrackingConfig",
    "TrainConfig",
    "TrainOverride",
    "apply_overrides",
    "federated_heads",
    "load_params",
    "parse_override",
    "validate_params",
]
