"""Draft heads (EAGLE-3, EAGLE-1/2; Medusa and distilled drafts later) behind one registry."""

from drafttrain.drafts.base import DraftHead, StepOutput, TargetFeatures
from drafttrain.drafts.registry import build_draft, draft_class, known_kinds, load_draft, register_draft

__all__ = [
    "DraftHead",
    "StepOutput",
    "TargetFeatures",
    "build_draft",
    "draft_class",
    "known_kinds",
    "load_draft",
    "register_draft",
]
