"""The target's own multi-token-prediction (MTP) layer as a draft: DeepSeek-V3 / Kimi-K2, GLM-4.5, Qwen3-Next and
Qwen3.5 ship one, which vLLM and SGLang serve as the draft (``method: mtp``). It was not updated in post-training, so
fine-tuning it on the target's own answers pays.

The layer (drafttrain.targets.mtp: transformers' MtpLayer around the target's decoder-layer class) reads the target's
final hidden state at position t and the embedding of token t+1, and predicts token t+2 through the target's own
lm_head (frozen, referenced, never copied). For the k-th draft token the same layer runs again on its own previous
output, as vLLM reuses a single MTP layer; which output (before or after its final norm) the family's vLLM model
recycles is the family's (targets.mtp). Training unrolls those steps the way decoding sees them: step k at anchor t
attends to the first step's keys up to t and to its own earlier steps' keys at t, nothing else (training-time
test), with each step's cross-entropy weighted by a decay (FastMTP) and an optional KL to the target.

It drafts through the ``eagle`` proposer (an EAGLE-1-like head: hidden state plus the next token's embedding), its
keys and values in transformers' own cache. Checkpoints hold the layer under the target's checkpoint keys, the layout
its codecs (drafttrain.drafts.formats.mtp) write for the engines.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from drafttrain import DrafttrainError
from drafttrain.config.kinds.mtp import MtpConfig
from drafttrain.drafts import losses
from drafttrain.drafts.base import StepOutput, saved_section, top1_hits
from drafttrain.drafts.eagle_head import EagleHead
from drafttrain.drafts.layers import shift_left
from drafttrain.drafts.lora import has_lora, merged_state
from drafttrain.runfolder import WEIGHTS_NAME, damaged
from drafttrain.targets import Target
from drafttrain.targets.hidden import decoder_layers, final_norm
from drafttrain.targets.mtp import (
    build_mtp_layer,
    load_native,
    mtp_family,
    native_state,
    native_tensors_in,
    rotary,
    text_config,
)
from drafttrain.targets.outputs import TargetNeeds, TargetOutputs

# config fields that say how the target was loaded, not what it is (an engine reads the weights' dtype from the
# export's own entry)
LOAD_FIELDS = ("dtype", "torch_dtype", "transformers_version", "use_cache", "output_attentions",
               "output_hidden_states", "return_dict", "architectures")


class MtpCache:
    """The MTP layer's keys and values while decoding (transformers' DynamicCache), cropped back to the accepted text
    after each proposal as the eagle proposer crops its heads' caches."""

    def __init__(self, config):
        self.cache = DynamicCache(config=config)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def crop(self, length: int) -> None:
        if self.length > length:
            self.cache.crop(length - self.length)  # transformers counts the tokens removed, negative


def additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = see) as the additive one transformers' attention takes."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, torch.finfo(dtype).min)


def unrolled_mask(valid: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, T, (step+1)·T]: what draft step ``step`` (0-based) at anchor t attends to while decoding. The keys of
    step 0 at anchors s <= t (the accepted text; padding left out, its own key always) and its own keys of steps
    1..step at anchor t (the tokens it drafted before); ``valid`` [B, T] is the attention mask."""
    batch, length = valid.shape
    index = torch.arange(length, device=valid.device)
    own = torch.eye(length, dtype=torch.bool, device=valid.device).expand(batch, length, length)
    causal = ((index[None, :] <= index[:, None])[None] & valid[:, None, :].bool()) | own
    return additive(torch.cat([causal, *[own] * step], dim=-1), dtype)[:, None]


def step_weights(steps: int, decay: float) -> list[float]:
    """FastMTP's weights: step k's loss weighs decay**k, normalised to sum to one."""
    raw = [decay**k for k in range(steps)]
    return [w / sum(raw) for w in raw]


class MtpDrafter(EagleHead):
    kind = "mtp"
    description = "the target's own multi-token-prediction (MTP) layer, drafting recursively"
    config_class = MtpConfig

    def __init__(self, config: MtpConfig, layer: nn.Module, target: Target):
        super().__init__(config)
        self.layers = nn.ModuleList([layer])
        self.layer_ids = [target.num_layers]  # the final, normed hidden state, as the engines feed an MTP layer
        self.family = mtp_family(target)
        self.attach_target(target)

    @property
    def layer(self) -> nn.Module:
        return self.layers[0]

    @property
    def feature_dtype(self) -> torch.dtype:
        return self.layer.eh_proj.weight.dtype

    # -- construction ------------------------------------------------------------------------------------
    @classmethod
    def target_needs(cls, config: MtpConfig, target: Target) -> TargetNeeds:
        return TargetNeeds(layers=(target.num_layers,), logits=True)

    @classmethod
    def build(cls, config: MtpConfig, target: Target, run=None) -> "MtpDrafter":
        drafter = cls(config, build_mtp_layer(target), target)
        return drafter.init_from_target(config.init_from_target).to(target.device)

    @torch.no_grad()
    def init_from_target(self, parts: list[str]) -> "MtpDrafter":
        if torch.device(self.target.device).type == "meta":  # `drafttrain plan`: shapes only, the same either way
            return self
        if "native" in parts:
            native = native_tensors_in(self.target.source_dir, self.target) if self.target.source_dir else None
            if native is None:
                raise DrafttrainError(
                    f"the target {self.target.name!r} ships no MTP layer in its checkpoint "
                    f"({self.target.source_dir or 'not loaded from a folder'}): set draft.init_from_target to [layer] "
                    "(its last decoder layer) or [] (a fresh layer)")
            load_native(self.layer, native, self.target, f"the target {self.target.name!r}")
        if "layer" in parts:
            self._copy_last_layer()
        return self

    def _copy_last_layer(self) -> None:
        """The MTP layer's decoder layer and final norm start as the target's last ones (same classes)."""
        last = decoder_layers(self.target.model)[-1]
        try:
            self.layer.mtp_block.load_state_dict(last.state_dict())
        except RuntimeError as err:
            raise DrafttrainError(f"draft.init_from_target 'layer': the target's last decoder layer is not of the "
                                  f"MTP layer's shape ({str(err).splitlines()[-1].strip()[:160]}): use [] for a fresh "
                                  "layer") from None
        self.layer.post_norm.load_state_dict(final_norm(self.target.model).state_dict())

    @classmethod
    def from_pretrained(cls, directory, target: Target, config: dict | None = None) -> "MtpDrafter":
        config = cls.read_checked_config(directory, target, config)
        drafter = cls(saved_section(MtpConfig, config), build_mtp_layer(target), target)
        drafter.load_weights(directory)
        return drafter.to(target.device)

    def load_weights(self, directory: str | Path) -> None:
        """The layer from a folder holding it under the target's checkpoint keys: a checkpoint, an export, or a whole
        model folder with it stitched in."""
        native = native_tensors_in(Path(directory), self.target)
        if native is None:
            raise damaged(Path(directory) / WEIGHTS_NAME, "holds no MTP layer of the target's family")
        load_native(self.layer, native, self.target, str(directory))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The layer under the target's checkpoint keys, as the engines load it (adapters merged)."""
        state = merged_state(self) if has_lora(self) else self.state_dict()
        layer = {name.removeprefix("layers.0."): value.detach().cpu() for name, value in state.items()}
        return native_state(layer, self.target)

    def interchange_config(self) -> dict:
        """The target's config with one MTP layer counted, under the field its family's engines read."""
        text = text_config(self.target)
        fields = {k: v for k, v in text.to_dict().items() if not k.startswith("_") and k not in LOAD_FIELDS}
        architectures = getattr(self.target.config, "architectures", None) or [type(self.target.model).__name__]
        return {"architectures": list(architectures), **fields, self.family.count_field: 1}

    def card_notes(self) -> list[str]:
        return ["vLLM serves the MTP layer with the target's own embeddings and lm_head, reusing the one layer for "
                "every draft token (`num_speculative_tokens`)"]

    def new_caches(self) -> list[MtpCache]:
        return [MtpCache(self.layer.config)]

    # -- the layer's forward, shared by training and decoding ---------------------------------------------------
    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.target.model.get_output_embeddings()
        return head(hidden.to(head.weight.dtype))

    def run_layer(self, hidden, input_ids, position_ids, mask, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the MTP layer: (what the next draft step reads, logits over the target's vocabulary)."""
        layer, dtype = self.layer, self.feature_dtype
        embeds = self.embed(input_ids).to(dtype)
        if self.family.masks_first_position:
            embeds = embeds.masked_fill((position_ids == 0)[..., None], 0)
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden.to(dtype))], dim=-1))
        x = layer.mtp_block(x, attention_mask=mask, position_embeddings=rotary(self.target)(x, position_ids),
                            position_ids=position_ids, cache=cache)
        normed = layer.post_norm(x)
        return (normed if self.family.recycles_normed else x), self.lm_head(normed)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        return taps  # the final hidden state itself

    def step(self, hidden, input_ids, position_ids, caches, mask=None):
        cache = caches[0].cache
        n, past = input_ids.shape[1], cache.get_seq_length()
        seen = mask if mask is not None else \
            torch.ones(n, past + n, dtype=torch.bool, device=input_ids.device).tril(past)
        return self.run_layer(hidden, input_ids, position_ids, additive(seen, self.feature_dtype)[None, None], cache)

    # -- training ------------------------------------------------------------------------------------------
    def unrolled(self, ids: torch.Tensor, valid: torch.Tensor, hidden: torch.Tensor, steps: int):
        """Each draft step's logits [B, T, V] over a whole row, as decoding computes them: step k at anchor t reads
        its hidden (the target's at k=0, its own output after), the true token t+1+k at position t+k, and predicts
        token t+2+k."""
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        cache = DynamicCache(config=self.layer.config)
        for k in range(steps):
            hidden, logits = self.run_layer(hidden, shift_left(ids, 1 + k), positions + k,
                                            unrolled_mask(valid, k, self.feature_dtype), cache)
            yield logits

    def training_step(self, batch: dict[str, torch.Tensor], outputs: TargetOutputs) -> StepOutput:
        ids, loss_mask = batch["input_ids"], batch["loss_mask"].float()
        valid = batch.get("attention_mask", torch.ones_like(ids))
        with torch.no_grad():
            target_ids = outputs.argmax if outputs.argmax is not None else outputs.logits.argmax(-1)
        weights = step_weights(self.config.steps, self.config.step_decay)
        total, metrics, correct, counted = 0.0, {}, [], []
        for k, logits in enumerate(self.unrolled(ids, valid, outputs.hidden, self.config.steps)):
            trainable = shift_left(loss_mask, 2 + k)  # the token step k predicts; its target distribution at t+1+k
            loss_k = self._step_loss(logits, shift_left(ids, 2 + k), shift_left(outputs.logits, 1 + k), trainable,
                                     metrics, k)
            total = total + weights[k] * loss_k
            with torch.no_grad():
                hits, n = top1_hits(logits.argmax(-1), shift_left(target_ids, 1 + k), trainable)
            correct.append(hits)
            counted.append(n)
        return StepOutput(loss=total, metrics=metrics, correct=correct, counted=counted)

    def _step_loss(self, logits, labels, target_logits, trainable, metrics: dict, k: int) -> torch.Tensor:
        loss = 0.0
        if self.config.ce_weight:
            ce = losses.cross_entropy(logits, labels, trainable)
            metrics[f"loss_ce_{k}"] = float(ce.detach())
            loss = loss + self.config.ce_weight * ce
        if self.config.kl_weight:
            kl = losses.forward_kl(logits, target_logits.detach(), trainable)
            metrics[f"loss_kl_{k}"] = float(kl.detach())
            loss = loss + self.config.kl_weight * kl
        return loss
