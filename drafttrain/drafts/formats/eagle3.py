"""EAGLE-3's serving formats (and P-EAGLE's): the interchange layout vLLM and SGLang load (``fc``, ``midlayer.*``,
``norm``, ``lm_head``, ``d2t``, ``t2d``), speculators' format, and the drafts speculators' and SpecForge's trainers
write, which ``drafttrain import`` reads.

The layer ids say which target layers feed fc, and each engine reads them its own way. drafttrain's id i is the input
of target layer i (HF's hidden_states[i]). vLLM reads the same; SGLang adds 1 to explicit ids (so it is given
i - 1); both default to (2, L/2, L-3), so default ids are left out. speculators keeps them explicit.
"""

from __future__ import annotations

import torch

from drafttrain import DrafttrainError, __version__
from drafttrain.config import Eagle3Config
from drafttrain.data.vocab import draft_vocab_for
from drafttrain.drafts.codecs import SPECULATORS_VERSION, Codec, Exported, ForeignReader, speculators_config
from drafttrain.drafts.eagle3 import Eagle3Drafter
from drafttrain.drafts.layers import check_foreign_layers, foreign_tensors
from drafttrain.drafts.peagle import PEagleDrafter
from drafttrain.drafts.taps import check_taps, low_mid_high_taps
from drafttrain.targets import Target

SPECULATORS_EMBEDDINGS = "embed_tokens.weight"  # the target's token embeddings, as speculators' files carry them
READER_OPTIONS = ("fc_norm", "norm_output", "sliding_window")


def _export_start(drafter: Eagle3Drafter, fmt: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The checkpoint's config (naming the format and the layer ids) and tensors, without the vocabulary maps where
    the head covers the whole vocabulary and the format has none: vLLM then refuses a d2t tensor at load, and
    speculators builds none (``read`` restores the identity)."""
    config = drafter.checkpoint_config(export={"format": fmt, "aux_layer_ids": list(drafter.layer_ids)})
    tensors = drafter.state_tensors()
    if fmt in ("vllm", "speculators") and drafter.d2t.numel() == drafter.target.vocab_size:
        tensors = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    return config, tensors


def _checkpoint_layout(config: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """An export's config and tensors with the checkpoint's layer ids and vocabulary maps back."""
    ids = config["drafttrain"]["export"]["aux_layer_ids"]
    config = {**config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}
    if "d2t" not in tensors:  # written without a map: the head covers the whole vocabulary
        d2t, t2d = draft_vocab_for(None, None, config["draft_vocab_size"])
        tensors = {**tensors, "d2t": d2t, "t2d": t2d}
    return config, tensors


class Interchange(Codec):
    """The layout vLLM (``vllm``) and SGLang (``sglang``) load, with each engine's layer numbering."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.engines = {"vllm": "eagle3"} if fmt == "vllm" else {"sglang": "EAGLE3"}

    def refusal(self, drafter: Eagle3Drafter) -> str | None:
        # SGLang's EAGLE-3 reader is not known to read EAGLE-3.1's norms or a draft window: a file it would load
        # without them would draft differently from the head that was trained, so it is not written
        options = [k for k in READER_OPTIONS if k in drafter.reader_options()]
        if self.fmt == "sglang" and options:
            return (f"an EAGLE-3.1 or sliding-window head ({', '.join(options)}) is written only where the reader is "
                    "known to apply them (vLLM, speculators)")
        return None

    def write(self, drafter: Eagle3Drafter) -> Exported:
        config, tensors = _export_start(drafter, self.fmt)
        ids, num_layers = list(drafter.layer_ids), drafter.target.num_layers
        engine_default = [2, num_layers // 2, num_layers - 3]
        if ids == engine_default:
            del config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        elif self.fmt == "sglang":
            config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids]
        notes = [f"reads target layers {ids} (the input of each; the engine's default)" if ids == engine_default
                 else f"reads target layers {ids} (the input of each), written explicitly"]
        return Exported(config, tensors, notes=notes)

    def read(self, config, tensors):
        return _checkpoint_layout(config, tensors)


class Speculators(Codec):
    """speculators' Eagle3Speculator: a Llama layer config, ``layers.0.*``, the target's token embeddings."""

    fmt = "speculators"
    engines, names_verifier = {"vllm": "eagle3"}, True

    def write(self, drafter: Eagle3Drafter) -> Exported:
        config, tensors = _export_start(drafter, self.fmt)
        layer = {k: v for k, v in config.items() if k not in (
            "architectures", "eagle_config", "draft_vocab_size", "target_hidden_size", "drafttrain", "mask_token_id",
            "fc_norm", "norm_output")}  # the window stays in the layer config: vLLM's Llama layer reads it there
        layer["num_hidden_layers"] = drafter.config.num_layers
        out = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]},
            "draft_vocab_size": config["draft_vocab_size"],
            "target_hidden_size": config["target_hidden_size"],
            "norm_before_residual": False,  # the residual is the un-normed hidden, as in EAGLE-3
            "fc_norm": drafter.config.fc_norm, "norm_output": drafter.config.norm_output,
            "eagle_aux_hidden_state_layer_ids": list(drafter.layer_ids),
            "speculators_config": speculators_config("eagle3", drafter.config.ttt_steps, drafter.target),
            "torch_dtype": "float32",
            "drafttrain": {**config["drafttrain"], "writer": f"drafttrain {__version__}"},
        }
        renamed = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
                   for k, v in tensors.items()}
        return Exported({**out, **self.fields(drafter)}, self.tensors(drafter, renamed))

    def fields(self, drafter: Eagle3Drafter) -> dict:
        """What a variant's config has instead of EAGLE-3's (its keys replace them)."""
        return {}

    def tensors(self, drafter: Eagle3Drafter, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The head's tensors with the target's token embeddings: speculators' loader fills them from the verifier
        only when the tensor is NaN, so a file without them loads HF's zero init."""
        table = drafter.target.model.get_input_embeddings().weight.detach().cpu().clone()
        return {**tensors, SPECULATORS_EMBEDDINGS: table}

    def read(self, config, tensors):
        layer = config["transformer_layer_config"]
        back = {**{k: v for k, v in layer.items() if k != "architectures"},
                "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": config["draft_vocab_size"],
                "target_hidden_size": config["target_hidden_size"], "drafttrain": config["drafttrain"],
                **self.read_fields(config)}
        tensors = self.read_tensors(config, tensors)
        tensors = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
                   for k, v in tensors.items() if k != SPECULATORS_EMBEDDINGS}
        return _checkpoint_layout(back, tensors)

    def read_fields(self, config: dict) -> dict:
        return {}

    def read_tensors(self, config: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors


class PEagleSpeculators(Speculators):
    """speculators' PEagleSpeculator: EAGLE-3's file with the mask token, its trained row in the embedding table and
    the mask state; vLLM serves it as eagle3 with parallel drafting (its pard_token is this mask_token_id)."""

    def fields(self, drafter: PEagleDrafter) -> dict:
        return {"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle",
                "mask_token_id": drafter.mask_token_id, "embed_requires_grad": True, "norm_before_fc": False,
                "speculators_config": speculators_config("peagle", drafter.config.parallel.depths, drafter.target)}

    def tensors(self, drafter: PEagleDrafter, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """P-EAGLE trains the mask token's row (speculators trains the table: the same row)."""
        tensors = super().tensors(drafter, {k: v for k, v in tensors.items() if k != "mask_embedding"})
        tensors[SPECULATORS_EMBEDDINGS][drafter.mask_token_id] = drafter.mask_embedding.detach().cpu()
        return tensors

    def engine_options(self, drafter: PEagleDrafter, engine: str) -> dict:
        """vLLM serves a P-EAGLE head as EAGLE-3 with parallel drafting."""
        return {"parallel_drafting": True}

    def read_fields(self, config: dict) -> dict:
        return {"mask_token_id": config["mask_token_id"]}

    def read_tensors(self, config: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # the mask token's trained row; the rest of the table is the target's own
        return {**tensors, "mask_embedding": tensors[SPECULATORS_EMBEDDINGS][config["mask_token_id"]]}


class NotWritten(Codec):
    """A format of the kind that drafts of a variant are not written in, and why."""

    def __init__(self, fmt: str, why: str):
        self.fmt, self.why = fmt, why

    def refusal(self, drafter) -> str:
        return self.why.format(drafter=drafter)


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
    parallel = {} if mask_token_id is None else {"parallel": {"depths": depth, "mask_token_id": mask_token_id}}
    return Eagle3Config(num_layers=layer["num_hidden_layers"], layers=ids, intermediate_size=layer["intermediate_size"],
                        fc_norm=fc_norm, norm_output=norm_output, sliding_window=window,
                        ttt_steps=min(depth, window - 1) if window else depth, **parallel)


def _target_embeddings(tensors: dict[str, torch.Tensor], mask_token_id: int, target: Target) -> bool:
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


def _check_speculators_layers(config: dict, tensors: dict[str, torch.Tensor], mask: int | None, target: Target) -> None:
    """What speculators' EAGLE-3 and P-EAGLE drafts may set that drafttrain's head does not compute, refused."""
    if any(".q_norm." in name or ".k_norm." in name for name in tensors):
        raise DrafttrainError("the draft's layers normalise q and k (Qwen3 layers: speculators' --draft-arch qwen3, "
                              "its P-EAGLE default), which drafttrain's EAGLE-3 layer does not compute: it would "
                              "load and draft something else (train it with --draft-arch llama)")
    check_foreign_layers(config, target)
    # a P-EAGLE file carries the target's table with its own mask row, which drafttrain's head does compute
    own_table = config.get("embed_requires_grad") and not (mask is not None and
                                                           _target_embeddings(tensors, mask, target))
    for flag, set_, why in (("norm_before_fc", config.get("norm_before_fc"), "one RMSNorm over the concatenated taps"),
                            ("norm_before_residual", config.get("norm_before_residual"),
                             "the residual taken after hidden_norm"),
                            ("embed_requires_grad", own_table, "token embeddings of its own, where drafttrain's "
                                                               "head reads the target's (and, for P-EAGLE, its "
                                                               "mask token's row)")):
        if set_:
            raise DrafttrainError(f"the draft sets {flag} ({why}), which drafttrain's EAGLE-3 head does not "
                                  "compute: it would load and draft something else")


class SpeculatorsTrained(ForeignReader):
    """An EAGLE-3 (or 3.1) or P-EAGLE draft as speculators' trainer saves it, or as `speculators convert` writes
    EAGLE / SpecForge heads."""

    fmt = "speculators"

    def recognises(self, config) -> bool:
        return config.get("speculators_model_type") in ("eagle3", "peagle")

    def read_foreign(self, config, tensors, target: Target):
        mask = config["mask_token_id"] if config.get("speculators_model_type") == "peagle" else None
        _check_speculators_layers(config, tensors, mask, target)
        ids = check_taps(config.get("eagle_aux_hidden_state_layer_ids") or low_mid_high_taps(target.num_layers),
                               target.num_layers)
        # its draft length (what the speculators export writes back; P-EAGLE's tokens per forward)
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        draft = foreign_section(config["transformer_layer_config"], ids,
                                int(methods[0].get("speculative_tokens") or 7), bool(config.get("fc_norm")),
                                bool(config.get("norm_output")), mask)
        own = foreign_tensors(tensors)
        if mask is not None:  # `read` keeps the mask token's row of the table alone (the target's, if none)
            own[SPECULATORS_EMBEDDINGS] = tensors.get(SPECULATORS_EMBEDDINGS,
                                                      target.model.get_input_embeddings().weight.detach()).float()
        codec = PEagleSpeculators() if mask is not None else Speculators()
        config, tensors = codec.read({**config, "drafttrain": {"export": {"aux_layer_ids": ids}}}, own)
        return draft, {k: v for k, v in config.items() if k != "drafttrain"}, tensors, []


class SpecForgeTrained(ForeignReader):
    """SpecForge's LlamaForCausalLMEagle3 (and EAGLE's layout): its ids in ``eagle_config`` are SGLang's (the output
    of layer i, so the input of i + 1; default (2, L/2, L-3) as inputs); its ``norm_output`` (default true) says
    whether the final norm comes before lm_head, which drafttrain's head always applies: the next step reads the
    un-normed hidden in SpecForge's training either way, so it is not speculators' EAGLE-3.1 ``norm_output``."""

    fmt = "specforge"

    def recognises(self, config) -> bool:
        # EAGLE's and SpecForge's trainers write the interchange layout (a Llama config, midlayer.*, fc, d2t/t2d)
        return config.get("architectures") == ["LlamaForCausalLMEagle3"]

    def read_foreign(self, config, tensors, target: Target):
        check_foreign_layers({"transformer_layer_config": config, "target_hidden_size": config.get("target_hidden_size")},
                             target)
        if config.get("norm_output") is False:
            raise DrafttrainError("the draft sets norm_output false (lm_head on the un-normed hidden), which "
                                  "drafttrain's EAGLE-3 head does not compute")
        explicit = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        ids = check_taps([i + 1 for i in explicit] if explicit else low_mid_high_taps(target.num_layers),
                               target.num_layers)
        draft = foreign_section(config, ids, 7, bool(config.get("fc_norm")), norm_output=False)
        tensors = foreign_tensors(tensors)
        config = {**{k: v for k, v in config.items() if k not in ("eagle_config", "norm_output")},
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}
        return draft, config, tensors, []


PEAGLE_WHY = ("a P-EAGLE head (parallel.depths {drafter.config.parallel.depths}) is served from speculators' format "
              "(vLLM reads its mask slots from there)")
EAGLE3_CODECS = [Interchange("vllm"), Interchange("sglang"), Speculators()]
PEAGLE_CODECS = [NotWritten("vllm", PEAGLE_WHY), NotWritten("sglang", PEAGLE_WHY), PEagleSpeculators()]
EAGLE3_READERS = [SpeculatorsTrained(), SpecForgeTrained()]
