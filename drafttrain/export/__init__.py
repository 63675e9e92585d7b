"""Ship a trained draft: write it in a serving engine's format with a model card (``export``), and push it to the
Hugging Face Hub (``hub``). What each kind looks like in each format is the kind's own business
(its codecs, drafttrain.drafts.codecs); this layer writes the files and says what was measured."""

from drafttrain.export.writer import export_draft

__all__ = ["export_draft"]
