"""P-EAGLE: an EAGLE-3 head that drafts several tokens in one forward (an EAGLE-3 draft section with
``parallel``, as speculators' ``peagle`` and SpecForge's ``peagle`` train it).

After the accepted text (pairs of a target state and the next token, as EAGLE-3 reads them), a proposal appends
k - 1 mask slots (drafttrain.drafts.parallel): the mask token's embedding (a learned row) and a learned hidden input
``mask_hidden`` (through the same fc as real taps), at the next positions, attending causally to the text and the
earlier mask slots. The last real pair predicts draft token 1, mask slot d predicts draft token d + 1: k tokens from
one forward. Training replaces the training-time test with COD sampling; a slot of anchor a at depth d sits at
position a + d, and its label is the target's distribution for token a + d + 2.
"""

from __future__ import annotations

import torch
from torch import nn

from drafttrain.config import Eagle3Config
from drafttrain.drafts import losses
from drafttrain.drafts.base import StepOutput
from drafttrain.drafts.eagle3 import Eagle3Drafter
from drafttrain.drafts.layers import LayerCache, resolve_mask_token, shift_left
from drafttrain.drafts.parallel import ParallelMask, Rollouts, cod_rollouts, parallel_mask
from drafttrain.targets import Target
from drafttrain.targets.outputs import TargetOutputs, rows_and_argmax

__all__ = ["PEagleDrafter", "ParallelMask", "Rollouts", "cod_rollouts", "parallel_mask"]


class PEagleDrafter(Eagle3Drafter):
    @classmethod
    def serves(cls, config: Eagle3Config) -> bool:
        return config.parallel is not None

    def __init__(self, config: Eagle3Config, layer_config, layer_ids: list[int], d2t, t2d, mask_token_id: int):
        super().__init__(config, layer_config, layer_ids, d2t, t2d)
        self.mask_token_id = mask_token_id
        # the mask slots' hidden input (before fc, as real taps) and token embedding
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, len(layer_ids) * layer_config.hidden_size))
        self.mask_embedding = nn.Parameter(torch.zeros(layer_config.hidden_size))

    @classmethod
    def built_extras(cls, config: Eagle3Config, target: Target) -> dict:
        return {"mask_token_id": resolve_mask_token(config.parallel.mask_token_id, target, "draft.parallel.mask_token_id")}

    @classmethod
    def saved_extras(cls, config: dict) -> dict:
        return {"mask_token_id": config["mask_token_id"]}

    @torch.no_grad()
    def init_from_target(self, parts: list[str]) -> "PEagleDrafter":
        # the mask token starts as the target's own embedding of it
        self.mask_embedding.copy_(self.target.model.get_input_embeddings().weight[self.mask_token_id])
        return super().init_from_target(parts)

    @classmethod
    def max_draft_depth(cls, config: Eagle3Config) -> int | None:
        return config.parallel.depths

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = super().embed(input_ids)
        return torch.where((input_ids == self.mask_token_id).unsqueeze(-1), self.mask_embedding.to(embeds.dtype), embeds)

    def mask_hidden_fused(self) -> torch.Tensor:
        """The hidden input of a mask slot: the learned mask state through fc, as a real tap is (1, 1, H)."""
        return self.fuse(self.mask_hidden)

    def interchange_extras(self) -> dict:
        return {"mask_token_id": self.mask_token_id}

    def card_notes(self) -> list[str]:
        return [f"A P-EAGLE head: it proposes up to {self.config.parallel.depths} tokens per forward from mask slots "
                f"(mask token {self.mask_token_id}). vLLM reads its speculators export (`speculators_model_type: "
                "peagle`) as EAGLE-3 with parallel drafting."]

    # -- training ------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, torch.Tensor], outputs: TargetOutputs) -> StepOutput:
        """Every real pair and a COD sample of mask slots in one forward per row;
        the loss is the soft cross-entropy to the target at every slot with a label, one mean over all depths."""
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].float()
        with torch.no_grad():
            target_ids, target_logits = rows_and_argmax(outputs, self.draft_to_target)
            by_argmax = self._trained_positions(target_ids)
        taps = outputs.hidden.to(self.fc.weight.dtype)
        if self.training and self.config.noise > 0:
            taps = taps + (torch.rand_like(taps) - 0.5) * self.config.noise
        k, total, weight = self.config.parallel.depths, 0.0, 0.0
        correct, counted = [0.0] * k, [0.0] * k
        for row in range(input_ids.shape[0]):
            # a slot at position p predicts token p + 2 from the target's distribution at p + 1
            trainable = shift_left(loss_mask[row: row + 1], 2)[0] * shift_left(by_argmax[row: row + 1], 1)[0]
            rollouts = cod_rollouts(trainable, k, self.config.parallel.cod_ratio, self.config.parallel.cod_min)
            logits, positions, depths = self._parallel_logits(taps[row], input_ids[row], rollouts)
            labels = shift_left(target_logits[row: row + 1], 1)[0][positions]
            mask = trainable[positions]
            per_slot = losses.per_position("soft_ce", losses.log_probs(logits), losses.log_probs(labels))
            total, weight = total + (per_slot * mask).sum(), weight + mask.sum()
            with torch.no_grad():
                hits = (self.draft_to_target[logits.argmax(-1)] == shift_left(target_ids[row: row + 1], 1)[0][positions])
                for d in range(k):
                    at = (depths == d).float() * (mask > 0)
                    correct[d] += float((hits.float() * at).sum())
                    counted[d] += float(at.sum())
        loss = total / weight.clamp(min=1.0) if isinstance(weight, torch.Tensor) else total
        return StepOutput(loss=loss, metrics={"mask_slots": float(sum(counted[1:]))}, correct=correct, counted=counted)

    def _parallel_logits(self, taps: torch.Tensor, input_ids: torch.Tensor, rollouts) -> tuple:
        """One row's real pairs (T) and mask slots (S) through the head: draft-vocabulary logits (T + S, V'), each
        slot's position and depth."""
        t = input_ids.shape[0]
        s = rollouts.anchors.numel()
        hidden = torch.cat([self.fuse(taps), self.mask_hidden_fused()[0].expand(s, -1)])[None]
        tokens = torch.cat([shift_left(input_ids[None], 1)[0],
                            torch.full((s,), self.mask_token_id, dtype=input_ids.dtype, device=input_ids.device)])
        positions = torch.cat([torch.arange(t, device=input_ids.device), rollouts.positions])
        depths = torch.cat([torch.zeros(t, dtype=torch.long, device=input_ids.device), rollouts.depths])
        cos, sin = self.rotary(hidden, positions[None])
        mask = ParallelMask(t, rollouts)  # never whole: a long row's (T + S)^2 is attended in chunks
        h = self.midlayer(hidden, self.embed(tokens[None]), cos, sin, LayerCache(), mask)
        for layer in self._extra_layers():
            h = layer(h, None, cos, sin, LayerCache(), mask)
        return self.lm_head(self.norm(h))[0], positions, depths
