"""DFlash's serving format: speculators' DFlashDraftModel, which vLLM serves (the checkpoint's own config is already
in its layout), and the DFlash drafts speculators' trainer (or a converter to its format) writes."""

from __future__ import annotations

import torch

from drafttrain import DrafttrainError, __version__
from drafttrain.config import DFlashConfig
from drafttrain.drafts.codecs import Codec, Exported, ForeignReader, speculators_config
from drafttrain.drafts.dflash import DFlashDrafter
from drafttrain.drafts.layers import check_foreign_layers, foreign_tensors
from drafttrain.drafts.taps import check_taps
from drafttrain.targets import Target


class Speculators(Codec):
    fmt = "speculators"
    engines, names_verifier = {"vllm": "dflash"}, True

    def write(self, drafter: DFlashDrafter) -> Exported:
        config = drafter.checkpoint_config(export={"format": self.fmt})
        depth = drafter.max_draft_depth(drafter.config)
        config["speculators_config"] = speculators_config("dflash", depth, drafter.target)
        config["drafttrain"]["writer"] = f"drafttrain {__version__}"
        tensors = drafter.state_tensors()
        notes = [f"drafts {depth} tokens per forward; block attention {drafter.config.block_attention}"]
        if drafter.d2t.numel() == drafter.t2d.numel():
            # vLLM wants d2t only for a draft vocabulary (the lm_head is the target's, whole)
            tensors = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
        return Exported(config, tensors, notes=notes)

    def read(self, config, tensors):
        config = {k: v for k, v in config.items() if k != "speculators_config"}
        if "d2t" not in tensors:  # a whole-vocabulary export: the identity map
            n = config["draft_vocab_size"]
            tensors = {**tensors, "d2t": torch.zeros(n, dtype=torch.long), "t2d": torch.ones(n, dtype=torch.bool)}
        return config, tensors


def foreign_block_attention(config: dict) -> str:
    """speculators' rule: a sliding-attention layer's block is causal unless ``sliding_window_non_causal``; a
    full-attention layer's is always bidirectional. drafttrain's draft has one block attention for all layers."""
    layer = config["transformer_layer_config"]
    types = layer.get("layer_types") or ["full_attention"] * layer["num_hidden_layers"]
    causal = {kind == "sliding_attention" and not config.get("sliding_window_non_causal") for kind in types}
    if len(causal) > 1:
        raise DrafttrainError(f"the draft mixes causal and bidirectional block layers ({types}, "
                              f"sliding_window_non_causal {config.get('sliding_window_non_causal')}): drafttrain's "
                              "DFlash draft has one block attention for every layer")
    return "causal" if causal.pop() else "bidirectional"


class SpeculatorsTrained(ForeignReader):
    """A DFlash draft speculators' trainer (or a converter to its format) wrote."""

    fmt = "speculators"

    def recognises(self, config) -> bool:
        return config.get("speculators_model_type") == "dflash"

    def read_foreign(self, config, tensors, target: Target):
        layer = config["transformer_layer_config"]
        check_foreign_layers(config, target)
        if config.get("mask_token_id") is None:
            raise DrafttrainError("the draft's config names no mask_token_id: the token its blocks were trained with "
                                  "is unknown (set it in config.json to the one its trainer used)")
        check_taps(config["aux_hidden_state_layer_ids"], target.num_layers)
        draft = DFlashConfig(num_layers=layer["num_hidden_layers"], block_size=config["block_size"],
                             layers=config["aux_hidden_state_layer_ids"], block_attention=foreign_block_attention(config),
                             sample_from_anchor=bool(config.get("sample_from_anchor")),
                             mask_token_id=config["mask_token_id"], intermediate_size=layer["intermediate_size"],
                             init_from_target=False)
        tensors = foreign_tensors(tensors)
        if "lm_head.weight" not in tensors:  # speculators omits a whole-vocabulary head: it is the target's own
            tensors["lm_head.weight"] = target.model.get_output_embeddings().weight.detach().float().cpu()
        config, tensors = Speculators().read(config, tensors)
        window = layer.get("sliding_window") if draft.block_attention == "causal" else None
        notes = [f"its layers attend within a sliding window of {window} tokens, which drafttrain does not model: "
                 f"contexts longer than {window} tokens are drafted with the whole context"] \
            if window and window < layer.get("max_position_embeddings", 0) else []
        return draft, config, tensors, notes


DFLASH_CODECS = [Speculators()]
DFLASH_READERS = [SpeculatorsTrained()]
