"""Medusa heads: K extra decoding heads on the target's final hidden state, each guessing one token further ahead.

At position t the target's own lm_head predicts token t+1; head i (i = 0..K-1) predicts token t+2+i. A head is
``num_layers`` residual blocks (x + SiLU(Linear(x)), the Linear starting at zero, bias too, so a fresh block passes
its input through exactly) and its own lm_head, which starts as the target's (its rows of the draft vocabulary). Loss: cross-entropy
per head against the data's token (or, with ``self_distill``, the target's own distribution), weighted
``loss_weight * decay**i``. The proposer (drafttrain.decoding.medusa) drafts a static tree of the heads' top-k.

Medusa-2 (``lora`` set): the target trains too, through LoRA adapters (peft) on the named modules. Its own loss is
KL(original target || adapted target) on the training tokens, so its answers stay close to the original; the
heads' loss is added. The adapters have their own learning rate and start after ``heads_only_steps`` (stage 1
trains the heads alone). Checkpoints hold the heads (``model.safetensors``), the adapter (``adapter/``) and, on
request, the adapted target merged into plain weights (``merged/``). Loading such a draft adapts the target it is
given, so the evaluator verifies against the adapted target.

Parameter names follow vLLM's Medusa layout: ``blocks.{h}.layers.{l}`` and ``lm_heads.{h}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from drafttrain import DrafttrainError
from drafttrain.config import MedusaConfig
from drafttrain.data.vocab import draft_ids, draft_vocab_for, target_to_draft, to_target_vocab
from drafttrain.drafts import losses
from drafttrain.drafts.base import Drafter, StepOutput, read_draft_config, saved_section, top1_hits, with_lora
from drafttrain.drafts.layers import check_target_sizes, shift_left
from drafttrain.runfolder import RunFolder, read_json, read_safetensors
from drafttrain.targets import Target
from drafttrain.targets.outputs import TargetNeeds, TargetOutputs, rows_and_argmax

ADAPTER_DIR = "adapter"
MERGED_DIR = "merged"


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=True) for _ in range(num_layers))
        for layer in self.layers:  # a fresh block passes its input through: x + SiLU(0) = x
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaDrafter(Drafter):
    kind = "medusa"
    description = "Medusa heads on the target's last hidden state"
    config_class = MedusaConfig
    proposer = "medusa"
    # heads on the final hidden state, with no layer of their own mirroring the target's attention: the model and
    # its sizes (its RoPE or context length may differ, as a long-context fine-tune's do)
    target_facts = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")

    def __init__(self, config: MedusaConfig, hidden_size: int, d2t: torch.Tensor, t2d: torch.Tensor):
        super().__init__(config)
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, config.num_layers) for _ in range(config.num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, d2t.numel(), bias=False)
                                      for _ in range(config.num_heads))
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        self.lora_names: list[str] = []

    # -- construction ------------------------------------------------------------------------------------
    @classmethod
    def target_needs(cls, config: MedusaConfig, target: Target) -> TargetNeeds:
        return TargetNeeds(final_hidden=True, logits=config.self_distill or config.trains_target)

    def needs(self) -> TargetNeeds:
        needs = super().needs()
        if self.config.self_distill and not self.config.trains_target:  # the soft targets are draft-vocabulary rows
            needs = dataclasses.replace(needs, logits_rows=self.draft_to_target)
        return needs

    @classmethod
    def build(cls, config: MedusaConfig, target: Target, run: RunFolder | None = None) -> "MedusaDrafter":
        d2t, t2d = draft_vocab_for(config.draft_vocab, run, target.vocab_size)
        drafter = cls(config, target.hidden_size, d2t, t2d).to(target.device).attach_target(target)
        if config.init_lm_head_from_target:
            with torch.no_grad():
                rows = target.model.get_output_embeddings().weight[drafter.draft_to_target]
                for head in drafter.lm_heads:
                    head.weight.copy_(rows)
        if config.target_lora is not None:
            drafter.lora_names = add_lora(target, config)
        return drafter

    @classmethod
    def from_pretrained(cls, directory, target: Target, config: dict | None = None) -> "MedusaDrafter":
        directory = Path(directory)
        config = config or read_draft_config(directory)
        cfg = saved_section(MedusaConfig, config)
        check_target_sizes(config, target, "the heads'")
        n = config.get("truncated_vocab_size") or target.vocab_size
        drafter = cls(cfg, target.hidden_size, torch.zeros(n, dtype=torch.long),
                      torch.zeros(target.vocab_size, dtype=torch.bool))
        drafter.load_weights(directory)
        drafter = drafter.to(target.device).attach_target(target)
        if (directory / ADAPTER_DIR).is_dir():
            drafter.lora_names = load_lora(target, directory / ADAPTER_DIR)
        return drafter

    @classmethod
    def max_draft_depth(cls, config: MedusaConfig) -> int:
        return config.num_heads  # one token per head

    # -- what it trains ----------------------------------------------------------------------------------
    def trainable_target_parameters(self) -> list[str]:
        return list(self.lora_names)

    def target_learning(self) -> tuple[float | None, int]:
        lora = self.config.target_lora
        return (lora.learning_rate, lora.heads_only_steps) if lora is not None else (None, 0)

    @property
    def adapts_target(self) -> bool:
        return bool(self.lora_names)

    def original_target(self):
        """Within it, the target computes as the original (adapters off)."""
        return self.target.model.disable_adapter() if self.adapts_target else contextlib.nullcontext()

    def card_notes(self) -> list[str]:
        if not self.adapts_target:
            return []
        return ["Medusa-2 trained the target too (LoRA): serve the adapted target in `target/` (merged), since the "
                "heads read its hidden states."]

    # -- forward pieces ------------------------------------------------------------------------------------
    @property
    def draft_to_target(self) -> torch.Tensor:
        return draft_ids(self.d2t)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., K, V_target]: each head's logits over the target vocabulary (-inf outside the draft vocab)."""
        out = torch.stack([head(block(hidden)) for block, head in zip(self.blocks, self.lm_heads)], dim=-2)
        return to_target_vocab(out, self.d2t, self.t2d)

    def interchange_config(self) -> dict:
        """vLLM's Medusa config (``model_type: medusa``)."""
        n, v = int(self.d2t.numel()), int(self.t2d.numel())
        return {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": self.target.hidden_size,
                "vocab_size": v, "num_heads": self.config.num_heads, "num_hidden_layers": self.config.num_layers,
                "medusa_fc_bias": True, "truncated_vocab_size": n if n < v else None}

    # -- save (its codecs: drafttrain.drafts.formats.medusa)  ------------------------------------------------
    def save_pretrained(self, directory, **meta) -> Path:
        directory = super().save_pretrained(directory, **meta)
        if self.adapts_target:
            save_lora(self.target, directory / ADAPTER_DIR)
            if self.config.target_lora.save_merged:
                save_merged(self.target, directory / MERGED_DIR)
        return directory

    # -- training ------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, torch.Tensor], outputs: TargetOutputs) -> StepOutput:
        cfg = self.config
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].float()
        hidden = outputs.final.to(self.lm_heads[0].weight.dtype)
        total, metrics, correct, counted = 0.0, {}, [], []
        for i, (block, head) in enumerate(zip(self.blocks, self.lm_heads)):
            logits = head(block(hidden))
            labels = target_to_draft(shift_left(input_ids, 2 + i), self.t2d)  # head i at t: token t+2+i
            weight = shift_left(loss_mask, 2 + i) * (labels >= 0).float()
            if cfg.self_distill:  # the target's distribution over token t+2+i sits at position t+1+i
                soft = shift_left(rows_and_argmax(outputs, self.draft_to_target)[1], 1 + i).detach()
                loss_i = losses.soft_cross_entropy(logits, soft, weight)
            else:
                loss_i = losses.cross_entropy(logits, labels, weight)
            total = total + cfg.loss_weight * cfg.decay**i * loss_i
            with torch.no_grad():
                hits, n = top1_hits(logits.argmax(-1), labels, weight)
                top_k = (logits.topk(min(cfg.top_k, logits.shape[-1]), dim=-1).indices == labels[..., None]).any(-1)
                metrics[f"loss_{i}"] = float(loss_i.detach())
                metrics[f"top{cfg.top_k}_{i}"] = float((top_k.float() * weight).sum() / weight.sum().clamp(min=1))
            correct.append(hits)
            counted.append(n)
        if cfg.target_lora is not None and cfg.target_lora.kl_weight > 0:
            kl = self._stay_close(batch, outputs.logits, loss_mask)
            metrics["loss_kl"] = float(kl.detach())
            total = total + cfg.target_lora.kl_weight * kl
        return StepOutput(loss=total, metrics=metrics, correct=correct, counted=counted)

    def _stay_close(self, batch, adapted_logits: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """KL(original target || adapted target) over the next-token distributions of the training tokens."""
        with torch.no_grad(), self.original_target():
            original = self.target.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                                         use_cache=False).logits
        return losses.forward_kl(adapted_logits, original, shift_left(loss_mask, 1))


def add_lora(target: Target, config: MedusaConfig) -> list[str]:
    """Wrap the target in LoRA adapters on the named modules; returns the names of the adapters' parameters."""
    target.model = with_lora(target.model, config.target_lora, target.name, "draft.target_lora")
    return [name for name, p in target.model.named_parameters() if p.requires_grad]


def save_lora(target: Target, directory: Path) -> None:
    """The adapter as peft writes it (adapter_config.json, adapter_model.safetensors)."""
    target.model.save_pretrained(str(directory), safe_serialization=True)


def load_lora(target: Target, directory: Path) -> list[str]:
    """Adapt the target with a saved adapter (or load it into an adapter already there, e.g. while training)."""
    from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict

    settings = read_json(directory / "adapter_config.json")
    state, _ = read_safetensors(directory / "adapter_model.safetensors")
    if not isinstance(target.model, PeftModel):
        target.model = get_peft_model(target.model, LoraConfig(**{k: settings[k] for k in (
            "r", "lora_alpha", "lora_dropout", "target_modules", "bias")}))
    result = set_peft_model_state_dict(target.model, state)
    if getattr(result, "unexpected_keys", None):
        raise DrafttrainError(f"the adapter in {directory} does not fit {target.name}: {result.unexpected_keys[:5]}")
    target.model.eval()
    return [name for name, p in target.model.named_parameters() if "lora_" in name]


@torch.no_grad()
def save_merged(target: Target, directory: Path) -> None:
    """The adapted target as a plain model folder: each adapted weight is base + the adapter's delta."""
    from peft.tuners.lora import LoraLayer  # peft imports in seconds: only for Medusa-2

    model = target.model
    base = model.get_base_model()
    state = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            state[f"{name}.weight"] = module.get_base_layer().weight + module.get_delta_weight("default")
            if module.get_base_layer().bias is not None:
                state[f"{name}.bias"] = module.get_base_layer().bias
    for name, param in base.state_dict().items():
        clean = name.replace(".base_layer.", ".")
        if "lora_" not in name and clean not in state:
            state[clean] = param
    base.save_pretrained(str(directory), state_dict={k: v.contiguous() for k, v in state.items()},
                         safe_serialization=True)
    if target.tokenizer is not None:
        target.tokenizer.save_pretrained(str(directory))
