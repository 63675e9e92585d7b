"""The draft sections a recipe may hold, one per kind: the built-in kinds' (a module each here), and any other kind's
added when drafttrain.drafts.registry.register_kind registers it (tests tie these lists to the kinds' registry)."""

from __future__ import annotations

from drafttrain.config.draft import DraftConfig
from drafttrain.config.kinds.dflash import DFlashConfig
from drafttrain.config.kinds.draft_model import DraftModelConfig, StudentLora
from drafttrain.config.kinds.eagle import EagleConfig
from drafttrain.config.kinds.eagle3 import Eagle3Config
from drafttrain.config.kinds.medusa import MedusaConfig
from drafttrain.config.kinds.mtp import MtpConfig

__all__ = ["DRAFT_KINDS", "DRAFT_SECTIONS", "DFlashConfig", "DraftModelConfig", "Eagle3Config", "EagleConfig",
           "MedusaConfig", "MtpConfig", "StudentLora"]

DRAFT_SECTIONS: list[type[DraftConfig]] = [Eagle3Config, EagleConfig, MedusaConfig, DraftModelConfig, DFlashConfig,
                                            MtpConfig]
DRAFT_KINDS: list[str] = [section.model_fields["kind"].default for section in DRAFT_SECTIONS]
