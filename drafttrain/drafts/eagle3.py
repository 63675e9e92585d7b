"""EAGLE-3 head: fused low/mid/high target features, one (or more) decoder layers, a reduced draft vocabulary,
trained with training-time test (the draft's own outputs fed back for k unrolled steps).

Parameter names follow the EAGLE-3 interchange layout that vLLM and SGLang load: ``fc``, ``midlayer.*``,
``norm``, ``lm_head``, ``d2t``, ``t2d`` (extra layers, if any, as ``layers.{i}.*``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from drafttrain import DrafttrainError, __version__
from drafttrain.config import Eagle3Config
from drafttrain.data.vocab import draft_ids, draft_vocab_for, to_target_vocab
from drafttrain.drafts import losses
from drafttrain.drafts.base import Exported, StepOutput, top1_hits
from drafttrain.drafts.eagle_head import EagleHead
from drafttrain.drafts.layers import DraftDecoderLayer, llama_config_like, shift_left
from drafttrain.runfolder import RunFolder
from drafttrain.targets.hidden import final_norm
from drafttrain.targets.loading import verifier_path
from drafttrain.targets.outputs import TargetNeeds, TargetOutputs, rows_and_argmax

SPECULATORS_EMBEDDINGS = "embed_tokens.weight"  # the target's token embeddings, as speculators' files carry them
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format the export writes (and is tested with)


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high taps: the inputs of layers 2, L/2 and L-3 (vLLM's and SpecForge's default), each
    once (a shallow target can map two of them to one layer)."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})


def check_aux_layers(layers: list[int], num_layers: int) -> list[int]:
    """The taps as vLLM and SGLang read them: ascending, unique, each the input of a real layer (< L)."""
    if layers != sorted(set(layers)) or any(not 0 <= i < num_layers for i in layers):
        raise DrafttrainError(
            f"EAGLE-3 aux layer ids {layers} must be ascending, unique and in 0..{num_layers - 1} for this "
            f"{num_layers}-layer target (i = the input of layer i; the final output is not a tap): serving engines "
            "collect the taps in layer order and never the final output"
        )
    return list(layers)


class Eagle3Drafter(EagleHead):
    kind = "eagle3"
    description = "an EAGLE-3 head on three of the target's hidden layers"
    engine_methods = {"vllm": "eagle3", "sglang": "EAGLE3"}
    config_class = Eagle3Config

    def __init__(self, config: Eagle3Config, layer_config, layer_ids: list[int], d2t, t2d):
        super().__init__(config)
        self.layer_config = layer_config
        self.layer_ids = list(layer_ids)
        h = layer_config.hidden_size
        self.fc = nn.Linear(len(layer_ids) * h, h, bias=False)
        self.midlayer = DraftDecoderLayer(layer_config, fuse_embedding=True)
        self.layers = nn.ModuleDict(
            {str(i): DraftDecoderLayer(layer_config, fuse_embedding=False) for i in range(1, config.num_layers)}
        )
        self.norm = LlamaRMSNorm(h, eps=layer_config.rms_norm_eps)
        self.lm_head = nn.Linear(h, d2t.numel(), bias=False)
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        self.rotary = LlamaRotaryEmbedding(layer_config)  # buffers only, not persistent

    # -- construction ------------------------------------------------------------------------------------
    @classmethod
    def aux_layers(cls, config: Eagle3Config, num_layers: int) -> list[int]:
        return check_aux_layers(config.layers or default_aux_layers(num_layers), num_layers)

    @classmethod
    def target_needs(cls, config: Eagle3Config, target) -> TargetNeeds:
        return TargetNeeds(layers=tuple(cls.aux_layers(config, target.num_layers)), logits=True)

    def needs(self) -> TargetNeeds:
        """Only the draft vocabulary's logits (and the full argmax, for the in-vocabulary mask) reach the loss."""
        return dataclasses.replace(super().needs(), logits_rows=self.draft_to_target)

    @classmethod
    def build(cls, config: Eagle3Config, target, run: RunFolder | None = None) -> "Eagle3Drafter":
        layer_ids = cls.aux_layers(config, target.num_layers)
        d2t, t2d = draft_vocab_for(config.draft_vocab, run, target.vocab_size)
        layer_config = llama_config_like(target.config, intermediate_size=config.intermediate_size)
        head = cls(config, layer_config, layer_ids, d2t, t2d).to(target.device).attach_target(target)
        return head.init_from_target(config.init_from_target)

    @torch.no_grad()
    def init_from_target(self, parts: list[str]) -> "Eagle3Drafter":
        super().init_from_target(parts)
        if "lm_head" in parts:  # the target's own output rows for the draft vocabulary, behind its final norm
            self.lm_head.weight.copy_(self.target.model.get_output_embeddings().weight[self.draft_to_target])
            self.norm.weight.copy_(final_norm(self.target.model).weight)
        return self

    def first_layer(self):
        return self.midlayer

    def init_fc_passthrough(self) -> None:
        h = self.layer_config.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, -h:] = torch.eye(h)

    @classmethod
    def from_pretrained(cls, directory, target) -> "Eagle3Drafter":
        config = cls.read_checked_config(directory, target)
        cfg = Eagle3Config.model_validate(config["drafttrain"]["draft"])
        layer_ids = check_aux_layers(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"], target.num_layers)
        n = config["draft_vocab_size"]
        layer_config = llama_config_like(target.config, intermediate_size=config["intermediate_size"])
        head = cls(cfg, layer_config, layer_ids, torch.zeros(n, dtype=torch.long),
                   torch.zeros(target.vocab_size, dtype=torch.bool))
        head.load_weights(directory)
        return head.to(target.device).attach_target(target)

    def interchange_config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            **self.llama_fields(),
            "target_hidden_size": self.layer_config.hidden_size,
            "draft_vocab_size": int(self.d2t.numel()),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids, "use_aux_hidden_state": True},
        }

    # -- export -------------------------------------------------------------------------------------------
    formats = ("vllm", "sglang", "speculators")

    def exported(self, fmt: str) -> Exported:
        """The layer ids say which target layers feed fc, and each engine reads them its own way. drafttrain's id i
        is the input of target layer i (HF's hidden_states[i]). vLLM reads the same; SGLang adds 1 to explicit ids
        (so it is given i - 1); both default to (2, L/2, L-3), so default ids are left out. speculators keeps them
        explicit."""
        ids = list(self.layer_ids)
        config = self.checkpoint_config(export={"format": fmt, "aux_layer_ids": ids})
        tensors = self.state_tensors()
        if fmt == "speculators":
            return self._speculators(config, tensors)
        num_layers = self.target.num_layers
        engine_default = [2, num_layers // 2, num_layers - 3]
        if ids == engine_default:
            del config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        elif fmt == "sglang":
            config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids]
        notes = [f"reads target layers {ids} (the input of each; the engine's default)" if ids == engine_default
                 else f"reads target layers {ids} (the input of each), written explicitly"]
        return Exported(config, tensors, notes=notes)

    def _speculators(self, config, tensors) -> Exported:
        layer = {k: v for k, v in config.items() if k not in (
            "architectures", "eagle_config", "draft_vocab_size", "target_hidden_size", "drafttrain")}
        layer["num_hidden_layers"] = self.config.num_layers
        out = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]},
            "draft_vocab_size": config["draft_vocab_size"],
            "target_hidden_size": config["target_hidden_size"],
            "norm_before_residual": False,  # the residual is the un-normed hidden, as in EAGLE-3
            "eagle_aux_hidden_state_layer_ids": list(self.layer_ids),
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.config.ttt_steps,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": verifier_path(self.target), "architectures": list(
                    getattr(self.target.config, "architectures", None) or [])},
            },
            "torch_dtype": "float32",
            "drafttrain": {**config["drafttrain"], "writer": f"drafttrain {__version__}"},
        }
        renamed = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
                   for k, v in tensors.items()}
        # speculators' checkpoints carry the target's token embeddings; its loader fills them from the verifier only
        # when the tensor is NaN, so a file without them loads a draft whose embeddings are HF's zero init
        renamed[SPECULATORS_EMBEDDINGS] = self.target.model.get_input_embeddings().weight.detach().cpu().clone()
        return Exported(out, renamed)

    @classmethod
    def imported(cls, fmt, config, tensors):
        ids = config["drafttrain"]["export"]["aux_layer_ids"]
        if fmt == "speculators":
            layer = config["transformer_layer_config"]
            config = {**{k: v for k, v in layer.items() if k != "architectures"},
                      "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": config["draft_vocab_size"],
                      "target_hidden_size": config["target_hidden_size"], "drafttrain": config["drafttrain"]}
            tensors = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
                       for k, v in tensors.items() if k != SPECULATORS_EMBEDDINGS}  # the target's own, not the draft's
        config = {**config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}
        return config, tensors

    # -- shared forward pieces ---------------------------------------------------------------------------
    @property
    def draft_to_target(self) -> torch.Tensor:
        return draft_ids(self.d2t)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        return self.fc(taps)

    def _extra_layers(self):
        return [self.layers[k] for k in sorted(self.layers, key=int)]

    def step(self, hidden, input_ids, position_ids, caches, mask=None):
        cos, sin = self.rotary(hidden, position_ids)
        h = self.midlayer(hidden, self.embed(input_ids), cos, sin, caches[0], mask)
        for layer, cache in zip(self._extra_layers(), caches[1:]):
            h = layer(h, None, cos, sin, cache, mask)
        return h, self.target_logits(self.lm_head(self.norm(h)))

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        return to_target_vocab(draft_logits, self.d2t, self.t2d)

    # -- training ------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, torch.Tensor], outputs: TargetOutputs) -> StepOutput:
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].float()
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        with torch.no_grad():  # the target's logits over the draft vocabulary, its argmax over all of it
            target_ids, target_logits = rows_and_argmax(outputs, self.draft_to_target)
            in_vocab = self.t2d[target_ids].float()
        taps = outputs.hidden.to(self.fc.weight.dtype)
        if self.training and self.config.noise > 0:
            taps = taps + (torch.rand_like(taps) - 0.5) * self.config.noise
        hidden = self.fuse(taps)
        blocks = [[] for _ in range(self.config.num_layers)]
        total, metrics, correct, counted = 0.0, {}, [], []
        for i in range(self.config.ttt_steps):
            # Step i at position t: hidden for t (real at i=0, the draft's own after), embedding of the true
            # token t+1+i; it predicts token t+2+i, whose target distribution sits at position t+1+i.
            trainable = shift_left(loss_mask, 2 + i)
            cos, sin = self.rotary(hidden, positions + i)
            h = self.midlayer.forward_ttt(hidden, self.embed(shift_left(input_ids, 1 + i)), cos, sin, blocks[0])
            for layer, layer_blocks in zip(self._extra_layers(), blocks[1:]):
                h = layer.forward_ttt(h, None, cos, sin, layer_blocks)
            logits = self.lm_head(self.norm(h))
            loss_i = losses.soft_cross_entropy(logits, shift_left(target_logits, 1 + i),
                                               trainable * shift_left(in_vocab, 1 + i))
            total = total + self.config.step_decay**i * loss_i
            with torch.no_grad():
                hits, n = top1_hits(self.draft_to_target[logits.argmax(-1)], shift_left(target_ids, 1 + i), trainable)
            correct.append(hits)
            counted.append(n)
            metrics[f"loss_{i}"] = float(loss_i.detach())
            hidden = h
        return StepOutput(loss=total, metrics=metrics, correct=correct, counted=counted)
