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
from drafttrain.data.vocab import draft_ids, draft_vocab_for, target_to_draft, to_target_vocab
from drafttrain.drafts import losses
from drafttrain.drafts.base import Exported, StepOutput, top1_hits
from drafttrain.drafts.eagle_head import EagleHead
from drafttrain.drafts.layers import (
    DraftDecoderLayer,
    check_foreign_layers,
    foreign_tensors,
    llama_config_like,
    shift_left,
)
from drafttrain.runfolder import RunFolder
from drafttrain.targets.hidden import final_norm_scale
from drafttrain.targets.loading import verifier_path
from drafttrain.targets.outputs import TargetNeeds, TargetOutputs, rows_and_argmax

SPECULATORS_EMBEDDINGS = "embed_tokens.weight"  # the target's token embeddings, as speculators' files carry them
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format the export writes (and is tested with)


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high taps: the inputs of layers 2, L/2 and L-3 (vLLM's and SpecForge's default), each
    once (a shallow target can map two of them to one layer)."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})


def foreign_window(layer: dict) -> int | None:
    """The sliding window of a foreign draft's layers (None: full attention); drafttrain's head has one attention
    for all its layers, so a mix, or sliding layers without a window, is refused rather than read as another."""
    types = set(layer.get("layer_types") or ["full_attention"])
    window = layer.get("sliding_window")
    if types == {"full_attention"} and not layer.get("use_sliding_window"):
        return None
    if types == {"sliding_attention"} or (types == {"full_attention"} and layer.get("use_sliding_window")):
        if not window:
            raise DrafttrainError("the draft's layers slide but name no sliding_window: its window is unknown")
        return int(window)
    raise DrafttrainError(f"the draft mixes layer types {sorted(types)}: drafttrain's EAGLE-3 head has one attention "
                          "for all its layers")


def foreign_section(layer: dict, ids: list[int], depth: int, fc_norm: bool, norm_output: bool,
                    mask_token_id: int | None = None) -> Eagle3Config:
    """The EAGLE-3 section of a foreign draft whose layers ``layer`` describes: its window read from them, its draft
    length ``depth`` kept as the training-time test's depth (below the window, which must exceed it). With a
    ``mask_token_id`` it is a P-EAGLE head drafting ``depth`` tokens a forward."""
    window = foreign_window(layer)
    parallel = {} if mask_token_id is None else {"parallel_depths": depth, "mask_token_id": mask_token_id}
    return Eagle3Config(num_layers=layer["num_hidden_layers"], layers=ids, intermediate_size=layer["intermediate_size"],
                        fc_norm=fc_norm, norm_output=norm_output, sliding_window=window,
                        ttt_steps=min(depth, window - 1) if window else depth, **parallel)


def _target_embeddings(tensors: dict[str, torch.Tensor], mask_token_id: int, target) -> bool:
    """Whether a P-EAGLE draft's embedding table is the target's apart from its mask token's row (compared in the
    file's dtype): what drafttrain's head computes, which reads the target's table and trains that row alone.
    speculators' P-EAGLE trains the whole table by default, which this refuses."""
    table = tensors.get(SPECULATORS_EMBEDDINGS)
    if table is None:
        return True
    ours = target.model.get_input_embeddings().weight.detach().to(table.dtype)
    if table.shape != ours.shape:
        return False
    rows = torch.ones(table.shape[0], dtype=torch.bool)
    rows[mask_token_id] = False
    return bool(torch.equal(table[rows], ours[rows]))


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
    adopts_vocabulary = True

    def __init__(self, config: Eagle3Config, layer_config, layer_ids: list[int], d2t, t2d):
        super().__init__(config)
        self.layer_config = layer_config
        self.layer_ids = list(layer_ids)
        h = layer_config.hidden_size
        self.fc = nn.Linear(len(layer_ids) * h, h, bias=False)
        if config.fc_norm:  # EAGLE-3.1: one norm per tap before fc (vLLM's and speculators' fc_norm.{i})
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(h, eps=layer_config.rms_norm_eps) for _ in layer_ids)
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
        layer_config = llama_config_like(target.config, intermediate_size=config.intermediate_size,
                                         sliding_window=config.sliding_window)
        head = cls(config, layer_config, layer_ids, d2t, t2d, **cls.built_extras(config, target))
        head = head.to(target.device).attach_target(target)
        return head.init_from_target(config.init_from_target)

    @classmethod
    def built_extras(cls, config: Eagle3Config, target) -> dict:
        """What a variant's constructor takes beside the head's own arguments, for a fresh draft."""
        return {}

    @classmethod
    def saved_extras(cls, config: dict) -> dict:
        """What a variant's constructor takes beside the head's own arguments, read from a saved config."""
        return {}

    @torch.no_grad()
    def init_from_target(self, parts: list[str]) -> "Eagle3Drafter":
        super().init_from_target(parts)
        if "lm_head" in parts:  # the target's own output rows for the draft vocabulary, behind its final norm
            self.lm_head.weight.copy_(self.target.model.get_output_embeddings().weight[self.draft_to_target])
            self.norm.weight.copy_(final_norm_scale(self.target.model))
        return self

    def adopt_vocabulary(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """The output rows of the tokens both vocabularies hold carry over as trained; the new tokens' rows start
        as the target's own (what init_from_target gives a fresh head)."""
        new_ids = draft_ids(d2t.to(self.d2t.device))
        old_rows = target_to_draft(new_ids, self.t2d)
        kept = old_rows >= 0
        weight = self.lm_head.weight
        self.lm_head = nn.Linear(weight.shape[1], new_ids.numel(), bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(self.target.model.get_output_embeddings().weight[new_ids])
            self.lm_head.weight[kept] = weight[old_rows[kept]]
        self.d2t, self.t2d = d2t.to(self.d2t.device).clone(), t2d.to(self.t2d.device).clone()

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
        layer_config = llama_config_like(target.config, intermediate_size=config["intermediate_size"],
                                         sliding_window=cfg.sliding_window)
        head = cls(cfg, layer_config, layer_ids, torch.zeros(n, dtype=torch.long),
                   torch.zeros(target.vocab_size, dtype=torch.bool), **cls.saved_extras(config))
        head.load_weights(directory)
        return head.to(target.device).attach_target(target)

    def interchange_config(self) -> dict:
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **self.llama_fields(),
            "target_hidden_size": self.layer_config.hidden_size,
            "draft_vocab_size": int(self.d2t.numel()),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.layer_ids, "use_aux_hidden_state": True},
        }
        return {**config, **self.interchange_extras(), **self._reader_options()}

    def interchange_extras(self) -> dict:
        """What a variant's interchange config adds after the EAGLE-3 fields."""
        return {}

    def _reader_options(self) -> dict:
        """EAGLE-3.1's flags and the sliding window, under the names vLLM and speculators read (a window as vLLM's
        Llama layers read it: per-layer types and one size); left out when off (the readers' default)."""
        fields = {name: True for name in ("fc_norm", "norm_output") if getattr(self.config, name)}
        if self.config.sliding_window is not None:
            fields.update(sliding_window=self.config.sliding_window, use_sliding_window=True,
                          layer_types=["sliding_attention"] * self.config.num_layers)
        return fields

    # -- export -------------------------------------------------------------------------------------------
    formats = ("vllm", "sglang", "speculators")

    def export_formats(self) -> tuple[str, ...]:
        # SGLang's EAGLE-3 reader is not known to read EAGLE-3.1's norms or a draft window: a file it would load
        # without them would draft differently from the head that was trained, so it is not written
        return ("vllm", "speculators") if self._reader_options() else self.formats

    def exported(self, fmt: str) -> Exported:
        """The layer ids say which target layers feed fc, and each engine reads them its own way. drafttrain's id i
        is the input of target layer i (HF's hidden_states[i]). vLLM reads the same; SGLang adds 1 to explicit ids
        (so it is given i - 1); both default to (2, L/2, L-3), so default ids are left out. speculators keeps them
        explicit."""
        ids = list(self.layer_ids)
        config = self.checkpoint_config(export={"format": fmt, "aux_layer_ids": ids})
        tensors = self.state_tensors()
        if fmt in ("vllm", "speculators") and self.d2t.numel() == self.target.vocab_size:
            # a head over the whole vocabulary has no map: vLLM then refuses a d2t tensor at load, and speculators
            # builds none (imported() restores the identity)
            tensors = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
        if fmt == "speculators":
            return self._speculators(config, tensors)
        if fmt not in self.export_formats():
            raise DrafttrainError(f"{self.why_not_written()}, not {fmt!r}: export --format "
                                  f"{' or '.join(self.export_formats())}")
        num_layers = self.target.num_layers
        engine_default = [2, num_layers // 2, num_layers - 3]
        if ids == engine_default:
            del config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        elif fmt == "sglang":
            config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids]
        notes = [f"reads target layers {ids} (the input of each; the engine's default)" if ids == engine_default
                 else f"reads target layers {ids} (the input of each), written explicitly"]
        return Exported(config, tensors, notes=notes)

    def why_not_written(self) -> str:
        """Why a format of the kind's is not one this draft is written in (export_formats)."""
        options = [k for k in ("fc_norm", "norm_output", "sliding_window") if k in self._reader_options()]
        return (f"an EAGLE-3.1 or sliding-window head ({', '.join(options)}) is written only where the reader is "
                "known to apply them (vLLM, speculators)")

    def _speculators(self, config, tensors) -> Exported:
        layer = {k: v for k, v in config.items() if k not in (
            "architectures", "eagle_config", "draft_vocab_size", "target_hidden_size", "drafttrain", "mask_token_id",
            "fc_norm", "norm_output")}  # the window stays in the layer config: vLLM's Llama layer reads it there
        layer["num_hidden_layers"] = self.config.num_layers
        out = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]},
            "draft_vocab_size": config["draft_vocab_size"],
            "target_hidden_size": config["target_hidden_size"],
            "norm_before_residual": False,  # the residual is the un-normed hidden, as in EAGLE-3
            "fc_norm": self.config.fc_norm, "norm_output": self.config.norm_output,
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
        return Exported({**out, **self.speculators_fields()}, self.speculators_tensors(renamed))

    def speculators_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The head's tensors as speculators' file carries them: with the target's token embeddings, since its loader
        fills them from the verifier only when the tensor is NaN (a file without them loads HF's zero init)."""
        table = self.target.model.get_input_embeddings().weight.detach().cpu().clone()
        return {**tensors, SPECULATORS_EMBEDDINGS: table}

    def speculators_fields(self) -> dict:
        """What a variant's speculators config has instead of EAGLE-3's (its keys replace them)."""
        return {}

    @classmethod
    def imported(cls, fmt, config, tensors):
        ids = config["drafttrain"]["export"]["aux_layer_ids"]
        if fmt == "speculators":
            layer = config["transformer_layer_config"]
            mask = config["mask_token_id"] if config.get("speculators_model_type") == "peagle" else None
            config = {**{k: v for k, v in layer.items() if k != "architectures"},
                      "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": config["draft_vocab_size"],
                      "target_hidden_size": config["target_hidden_size"], "drafttrain": config["drafttrain"],
                      **({} if mask is None else {"mask_token_id": mask})}
            if mask is not None:  # P-EAGLE: the mask token's trained row; the rest is the target's own
                tensors = {**tensors, "mask_embedding": tensors[SPECULATORS_EMBEDDINGS][mask]}
            tensors = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
                       for k, v in tensors.items() if k != SPECULATORS_EMBEDDINGS}
        config = {**config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}
        if "d2t" not in tensors:  # written without a map: the head covers the whole vocabulary
            d2t, t2d = draft_vocab_for(None, None, config["draft_vocab_size"])
            tensors = {**tensors, "d2t": d2t, "t2d": t2d}
        return config, tensors

    foreign_formats = ("speculators", "specforge")

    @classmethod
    def foreign_format(cls, config):
        if config.get("speculators_model_type") in ("eagle3", "peagle"):  # P-EAGLE: this kind's parallel_depths
            return "speculators"
        # EAGLE's and SpecForge's trainers write the interchange layout (a Llama config, midlayer.*, fc, d2t/t2d)
        return "specforge" if config.get("architectures") == ["LlamaForCausalLMEagle3"] else None

    @classmethod
    def foreign_draft(cls, config, tensors, target):
        """An EAGLE-3 (or 3.1) draft as speculators' Eagle3DraftModel saves it (a speculators trainer's checkpoint, or
        what `speculators convert` writes from EAGLE / SpecForge heads), or as EAGLE's and SpecForge's trainers do."""
        if "transformer_layer_config" not in config:
            return cls._specforge_draft(config, tensors, target)
        layer = config["transformer_layer_config"]
        if any(".q_norm." in name or ".k_norm." in name for name in tensors):
            raise DrafttrainError("the draft's layers normalise q and k (Qwen3 layers: speculators' --draft-arch qwen3, "
                                  "its P-EAGLE default), which drafttrain's EAGLE-3 layer does not compute: it would "
                                  "load and draft something else (train it with --draft-arch llama)")
        check_foreign_layers(config, target)
        mask = config["mask_token_id"] if config.get("speculators_model_type") == "peagle" else None
        # a P-EAGLE file carries the target's table with its own mask row, which drafttrain's head does compute
        own_table = config.get("embed_requires_grad") and not (mask is not None and
                                                               _target_embeddings(tensors, mask, target))
        for flag, set_, why in (("norm_before_fc", config.get("norm_before_fc"),
                                 "one RMSNorm over the concatenated taps"),
                                ("norm_before_residual", config.get("norm_before_residual"),
                                 "the residual taken after hidden_norm"),
                                ("embed_requires_grad", own_table, "token embeddings of its own, where drafttrain's "
                                                                   "head reads the target's (and, for P-EAGLE, its "
                                                                   "mask token's row)")):
            if set_:
                raise DrafttrainError(f"the draft sets {flag} ({why}), which drafttrain's EAGLE-3 head does not "
                                      "compute: it would load and draft something else")
        ids = check_aux_layers(config.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target.num_layers),
                               target.num_layers)
        # its draft length (what the speculators export writes back; P-EAGLE's tokens per forward)
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        draft = foreign_section(layer, ids, int(methods[0].get("speculative_tokens") or 7),
                                bool(config.get("fc_norm")), bool(config.get("norm_output")), mask)
        own = foreign_tensors(tensors)
        if mask is not None:  # `imported` keeps the mask token's row of the table alone (the target's, if none)
            own[SPECULATORS_EMBEDDINGS] = tensors.get(SPECULATORS_EMBEDDINGS,
                                                      target.model.get_input_embeddings().weight.detach()).float()
        config, tensors = cls.imported("speculators", {**config, "drafttrain": {"export": {"aux_layer_ids": ids}}}, own)
        return draft, {k: v for k, v in config.items() if k != "drafttrain"}, tensors, []

    @classmethod
    def _specforge_draft(cls, config, tensors, target):
        """SpecForge's LlamaForCausalLMEagle3 (and EAGLE's layout): its ids in ``eagle_config`` are SGLang's (the output
        of layer i, so the input of i + 1; default (2, L/2, L-3) as inputs); its ``norm_output`` (default true) says
        whether the final norm comes before lm_head, which drafttrain's head always applies: the next step reads the
        un-normed hidden in SpecForge's training either way, so it is not speculators' EAGLE-3.1 ``norm_output``."""
        check_foreign_layers({"transformer_layer_config": config, "target_hidden_size": config.get("target_hidden_size")},
                             target)
        if config.get("norm_output") is False:
            raise DrafttrainError("the draft sets norm_output false (lm_head on the un-normed hidden), which "
                                  "drafttrain's EAGLE-3 head does not compute")
        explicit = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        ids = check_aux_layers([i + 1 for i in explicit] if explicit else default_aux_layers(target.num_layers),
                               target.num_layers)
        draft = foreign_section(config, ids, 7, bool(config.get("fc_norm")), norm_output=False)
        tensors = foreign_tensors(tensors)
        config = {**{k: v for k, v in config.items() if k not in ("eagle_config", "norm_output")},
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}
        return draft, config, tensors, []

    # -- shared forward pieces ---------------------------------------------------------------------------
    @property
    def draft_to_target(self) -> torch.Tensor:
        return draft_ids(self.d2t)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        if self.config.fc_norm:
            taps = torch.cat([norm(tap) for norm, tap in zip(self.fc_norm, taps.chunk(len(self.fc_norm), -1))], -1)
        return self.fc(taps)

    def head_out(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft-vocabulary logits of a layer output, and the hidden the next step reads: the output itself, or
        with EAGLE-3.1's norm_output its final-normed form (the one the logits are computed from)."""
        normed = self.norm(h)
        return (normed if self.config.norm_output else h), self.lm_head(normed)

    def _extra_layers(self):
        return [self.layers[k] for k in sorted(self.layers, key=int)]

    def step(self, hidden, input_ids, position_ids, caches, mask=None):
        cos, sin = self.rotary(hidden, position_ids)
        positions = position_ids[0]  # where each new entry sits: a sliding window reads it
        h = self.midlayer(hidden, self.embed(input_ids), cos, sin, caches[0], mask, positions)
        for layer, cache in zip(self._extra_layers(), caches[1:]):
            h = layer(h, None, cos, sin, cache, mask, positions)
        h, logits = self.head_out(h)
        return h, self.target_logits(logits)

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        return to_target_vocab(draft_logits, self.d2t, self.t2d)

    # -- training ------------------------------------------------------------------------------------------
    def _trained_positions(self, target_ids: torch.Tensor) -> torch.Tensor:
        """1.0 where the loss reads a position by its target argmax: in the draft vocabulary (a token outside it
        can never be accepted), or everywhere with ``train_out_of_vocab``."""
        if self.config.train_out_of_vocab:
            return torch.ones(target_ids.shape, dtype=torch.float32, device=target_ids.device)
        return self.t2d[target_ids].float()

    def training_step(self, batch: dict[str, torch.Tensor], outputs: TargetOutputs) -> StepOutput:
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].float()
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        with torch.no_grad():  # the target's logits over the draft vocabulary, its argmax over all of it
            target_ids, target_logits = rows_and_argmax(outputs, self.draft_to_target)
            by_argmax = self._trained_positions(target_ids)
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
            h, logits = self.head_out(h)
            loss_i = losses.soft_cross_entropy(logits, shift_left(target_logits, 1 + i),
                                               trainable * shift_left(by_argmax, 1 + i))
            total = total + self.config.step_decay**i * loss_i
            with torch.no_grad():
                hits, n = top1_hits(self.draft_to_target[logits.argmax(-1)], shift_left(target_ids, 1 + i), trainable)
            correct.append(hits)
            counted.append(n)
            metrics[f"loss_{i}"] = float(loss_i.detach())
            hidden = h
        return StepOutput(loss=total, metrics=metrics, correct=correct, counted=counted)
