"""Draft kinds (EAGLE-3, EAGLE-1/2, Medusa-1/2, draft models), one registry entry each."""

from drafttrain.drafts.base import Drafter, StepOutput
from drafttrain.drafts.continuation import start_drafter
from drafttrain.drafts.registry import KINDS, build_drafter, drafter_class, drafter_for
from drafttrain.drafts.saved import SavedDraft, load_drafter

__all__ = ["KINDS", "Drafter", "SavedDraft", "StepOutput", "build_drafter", "drafter_class", "drafter_for", "load_drafter",
           "start_drafter"]
