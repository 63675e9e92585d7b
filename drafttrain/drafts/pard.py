"""PARD: a draft model that drafts several tokens in one forward (a draft_model section with ``parallel``, as AMD's
PARD trains it and vLLM 0.16 and later serve it with parallel drafting).

After the accepted text, k - 1 mask tokens at the next positions (drafttrain.drafts.parallel): the last real token
predicts draft token 1, mask d predicts draft token d + 1. Training scores the real tokens and COD-sampled mask slots
of each row in one forward under a 4D mask, each at its own position.
"""

from __future__ import annotations

import torch

from drafttrain import DrafttrainError
from drafttrain.config import DraftModelConfig
from drafttrain.drafts.draft_model import DraftModelDrafter
from drafttrain.drafts.layers import resolve_mask_token, shift_left
from drafttrain.drafts.parallel import cod_rollouts, parallel_mask
from drafttrain.targets import Target
from drafttrain.targets.hidden import decoder
from drafttrain.targets.masks import additive_mask
from drafttrain.targets.outputs import TargetOutputs


class PardDrafter(DraftModelDrafter):
    @classmethod
    def serves(cls, config: DraftModelConfig) -> bool:
        return config.parallel is not None

    def __init__(self, config: DraftModelConfig, student: torch.nn.Module,
                 vocab: tuple[torch.Tensor, torch.Tensor] | None = None, *, mask_token_id: int):
        super().__init__(config, student, vocab)
        self.mask_token_id = mask_token_id

    @classmethod
    def built_extras(cls, config: DraftModelConfig, target: Target) -> dict:
        return {"mask_token_id": resolve_mask_token(config.parallel.mask_token_id, target, "draft.parallel.mask_token_id")}

    @classmethod
    def saved_extras(cls, config: dict) -> dict:
        return {"mask_token_id": config.get("pard_token")}

    @classmethod
    def max_draft_depth(cls, config: DraftModelConfig) -> int | None:
        return config.parallel.depths

    def card_notes(self) -> list[str]:
        return [f"A PARD draft: it proposes up to {self.config.parallel.depths} tokens per forward after mask token "
                f"{self.mask_token_id} (`pard_token` in config.json); vLLM 0.16 and later draft them in one forward."]

    def interchange_config(self) -> dict:
        """Its mask token as vLLM's parallel drafting reads it (``pard_token``) and as PARD's own code does."""
        return {"pard_token": self.mask_token_id, "mask_token_id": self.mask_token_id, "spd_type": "pard"}

    def scored_logits(self, batch: dict[str, torch.Tensor], rows: torch.Tensor | None, outputs: TargetOutputs) \
            -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The real tokens and COD-sampled mask slots, each scored at its own position."""
        if outputs.top_k is not None:
            raise DrafttrainError("draft.parallel (PARD) takes the target's logits online: set "
                                  "training.hidden_states: online (a teacher cache holds no mask slots)")
        return self.parallel_logits(batch, rows)

    def parallel_logits(self, batch: dict[str, torch.Tensor], rows: torch.Tensor | None) \
            -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """PARD's training layout (drafttrain.drafts.parallel's COD sampler and mask): per row, its real tokens and mask
        slots (anchor a, depth d: the text up to a, then d mask tokens; at position a + d, predicting token a + d + 1)
        in one forward under a 4D mask. Returns the logits (B, N, V), each slot's position and depth (B, N), the rows
        padded to the longest with position -1 (``_at`` gives them weight 0)."""
        input_ids = batch["input_ids"]
        trainable = shift_left(batch["loss_mask"].float(), 1)
        outs, places, levels = [], [], []
        for row in range(input_ids.shape[0]):
            ids, t = input_ids[row], input_ids.shape[1]
            rollouts = cod_rollouts(trainable[row], self.config.parallel.depths, self.config.parallel.cod_ratio,
                                    self.config.parallel.cod_min)
            masks = torch.full_like(rollouts.anchors, self.mask_token_id)
            positions = torch.cat([torch.arange(t, device=ids.device), rollouts.positions])
            mask = additive_mask(parallel_mask(t, rollouts), 0, self.student.dtype, ids.device)
            inputs = dict(input_ids=torch.cat([ids, masks])[None], position_ids=positions[None], attention_mask=mask,
                          use_cache=False)
            if rows is None:
                outs.append(self.aligned(self.student(**inputs).logits)[0])
            else:
                hidden = decoder(self.student)(**inputs).last_hidden_state
                outs.append(torch.nn.functional.linear(hidden, self.student.get_output_embeddings().weight[rows])[0])
            places.append(positions)
            levels.append(torch.cat([torch.zeros(t, dtype=torch.long, device=ids.device), rollouts.depths]))
        n = max(len(p) for p in places)
        logits = torch.stack([torch.nn.functional.pad(o, (0, 0, 0, n - len(o))) for o in outs])
        scored_at = torch.stack([torch.nn.functional.pad(p, (0, n - len(p)), value=-1) for p in places])
        return logits, scored_at, torch.stack([torch.nn.functional.pad(d, (0, n - len(d))) for d in levels])
