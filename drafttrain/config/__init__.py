"""The one typed schema of recipes and CLI flags. Every stage reads its section from here; nothing reads raw YAML.

base (what a section is), shared (sub-sections several kinds use), draft (what every draft section has), kinds/ (a
module per built-in kind), data, training, decode (and eval), bench, and recipe (the whole, loaded and validated)."""

from drafttrain.config.base import SETTING_ERROR, Section, needed_packages, positive_int, setting_error
from drafttrain.config.bench import BenchConfig
from drafttrain.config.capture import CaptureConfig
from drafttrain.config.data import DataConfig, RegenerateConfig, ReplayConfig, SourceConfig
from drafttrain.config.decode import DecodeSettings, EngineEvalSettings, EvalConfig
from drafttrain.config.draft import DraftConfig, DraftVocabConfig
from drafttrain.config.errors import describe_errors, format_validation_error
from drafttrain.config.kinds import (
                                     DRAFT_KINDS,
                                     DRAFT_SECTIONS,
                                     DFlashConfig,
                                     DraftModelConfig,
                                     Eagle3Config,
                                     EagleConfig,
                                     MedusaConfig,
                                     StudentLora,
)
from drafttrain.config.recipe import (
                                     DraftSection,
                                     Recipe,
                                     TargetConfig,
                                     WandbConfig,
                                     apply_overrides,
                                     load_recipe,
                                     parse_recipe,
                                     register_draft_section,
                                     unregister_draft_section,
)
from drafttrain.config.shared import DraftLora, LoraSettings, ParallelDrafting, TargetLora
from drafttrain.config.training import TrainingConfig

__all__ = ["DRAFT_KINDS", "DRAFT_SECTIONS", "SETTING_ERROR", "BenchConfig", "CaptureConfig", "DFlashConfig", "DataConfig", "DecodeSettings",
           "DraftConfig", "DraftLora", "DraftModelConfig", "DraftSection", "DraftVocabConfig", "Eagle3Config",
           "EagleConfig", "EngineEvalSettings", "EvalConfig", "LoraSettings", "MedusaConfig", "ParallelDrafting", "Recipe", "RegenerateConfig",
           "ReplayConfig", "Section", "SourceConfig", "StudentLora", "TargetConfig", "TargetLora", "TrainingConfig",
           "WandbConfig", "apply_overrides", "describe_errors", "format_validation_error", "load_recipe",
           "needed_packages", "parse_recipe", "positive_int", "register_draft_section", "setting_error",
           "unregister_draft_section"]
