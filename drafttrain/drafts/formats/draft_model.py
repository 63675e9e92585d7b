"""The draft model's serving format: the checkpoint itself, a plain HF model folder that vLLM, SGLang and HF assisted
generation take as a draft model (llama.cpp after conversion); a PARD draft is the same folder, served with
parallel drafting."""

from __future__ import annotations

from typing import Any

from drafttrain.drafts.codecs import Codec, Exported
from drafttrain.drafts.draft_model import DraftModelDrafter
from drafttrain.drafts.pard import PardDrafter


class Hf(Codec):
    fmt = "hf"
    engines = {"vllm": "draft_model"}

    def write(self, drafter: DraftModelDrafter) -> Exported:
        notes = ["trained on its draft vocabulary only (loss_vocab: draft): engines that draft from the whole "
                 "vocabulary (vLLM, HF assisted generation) accept fewer of its tokens than drafttrain's proposer, "
                 "which reads draft_vocab/ (BENCHMARKS.md)"] if drafter.loss_rows is not None else []
        return Exported({"drafttrain": drafter.checkpoint_config(export={"format": self.fmt})["drafttrain"]},
                        folders={"": drafter.save_pretrained}, notes=notes)

    def read(self, config, tensors):
        return config, tensors


class PardHf(Hf):
    def engine_options(self, drafter: PardDrafter, engine: str) -> dict[str, Any]:
        """vLLM 0.16 and later serve a PARD draft with parallel drafting (its mask token is ``pard_token``)."""
        return {"parallel_drafting": True}


DRAFT_MODEL_CODECS = [Hf()]
PARD_CODECS = [PardHf()]
