"""A target's own multi-token-prediction (MTP) layer, built with transformers' classes and read from (or written
under) the keys the family's checkpoints and the serving engines use.

Families that ship MTP layers differ in three ways, all said here (``MtpFamily``) and nowhere else:

* where the checkpoint keeps the layer: DeepSeek-V3 / Kimi-K2 and GLM-4.5 as one more decoder layer,
  ``model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm,<decoder layer>}``; Qwen3-Next and Qwen3.5 beside the
  model, ``mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,norm,layers.0.<decoder layer>}``;
* which config field counts the layers (what the engines read to build it);
* how vLLM 0.32 runs the layer recursively: which of its outputs the next draft step reads (its decoder output
  before the final norm, GLM-4.5; after it, DeepSeek-V3 and the Qwens), and whether the token embedding at position
  0 is zeroed (DeepSeek-V3, GLM-4.5: ``vllm/model_executor/models/{deepseek,glm4_moe,qwen3_next,qwen3_5}_mtp.py``).

The layer is ``transformers.modeling_layers.MtpLayer`` around the target's own decoder-layer and norm classes, its
config transformers' ``get_mtp_config()`` (for a family without ``num_mtp_layers``, the text config given one full
attention MTP layer, as the Qwens' is). Weights are read through transformers' own conversions (``MtpModel``'s
renamings, then the target's: experts stored one by one are fused as the modules hold them) and written back
through their reverse, so the keys are the checkpoint's. The target's embeddings and lm_head are never part of it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from drafttrain import DrafttrainError
from drafttrain.runfolder import WEIGHTS_NAME
from drafttrain.targets.hidden import decoder, decoder_layers
from drafttrain.targets.loading import Target

INDEX_NAME = "model.safetensors.index.json"
# what a DeepSeek-layout MTP layer stores beside its own weights: copies of the target's embedding and lm_head
# (engines share the target's), never read
TARGET_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


@dataclasses.dataclass(frozen=True)
class MtpFamily:
    """How a family stores its MTP layer and how vLLM runs it (see the module docstring)."""

    beside: bool  # the layer sits beside the model (``mtp.*``), not as decoder layer L
    count_field: str  # the config field the engines read the MTP layer count from
    recycles_normed: bool  # the next draft step reads the layer's output after its final norm
    masks_first_position: bool  # vLLM zeroes the token embedding at position 0

    def prefix(self, num_layers: int) -> str:
        return "mtp." if self.beside else f"model.layers.{num_layers}."

    def block_prefix(self, num_layers: int) -> str:
        """Where the decoder layer's own weights sit."""
        return "mtp.layers.0." if self.beside else f"model.layers.{num_layers}."

    @property
    def parts(self) -> dict[str, str]:
        """MtpLayer's own modules -> their names in the checkpoint."""
        if self.beside:
            return {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
                    "post_norm": "norm"}
        return {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "post_norm": "shared_head.norm"}

    def next_layer(self, num_layers: int) -> str:
        """Where a second MTP layer would start (the layer drafttrain trains is the first)."""
        return "mtp.layers.1." if self.beside else f"model.layers.{num_layers + 1}."


_LAYERED = dict(beside=False, count_field="num_nextn_predict_layers", masks_first_position=True)
_BESIDE = dict(beside=True, recycles_normed=True, masks_first_position=False)
FAMILIES: dict[str, MtpFamily] = {
    "deepseek_v3": MtpFamily(**_LAYERED, recycles_normed=True),
    "kimi_k2": MtpFamily(**_LAYERED, recycles_normed=True),
    "glm4_moe": MtpFamily(**_LAYERED, recycles_normed=False),
    "qwen3_next": MtpFamily(**_BESIDE, count_field="num_nextn_predict_layers"),
    "qwen3_5_text": MtpFamily(**_BESIDE, count_field="mtp_num_hidden_layers"),
    "qwen3_5_moe_text": MtpFamily(**_BESIDE, count_field="mtp_num_hidden_layers"),
}


def text_config(target: Target):
    return target.config.get_text_config(decoder=True)


def mtp_family(target: Target) -> MtpFamily:
    model_type = getattr(text_config(target), "model_type", None)
    if model_type not in FAMILIES:
        raise DrafttrainError(f"the target {target.name!r} ({model_type}) is not a family whose MTP layers drafttrain "
                              f"builds and the engines serve (model types: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def mtp_layer_config(target: Target):
    """The config an MTP layer is built from: transformers' ``get_mtp_config()`` for one layer, with attention that
    takes explicit masks (training attends over several draft steps at once, decoding over tree nodes)."""
    config = copy.deepcopy(text_config(target))
    config.num_mtp_layers = 1
    if getattr(config, "layer_types", None) is not None and getattr(config, "mtp_layer_types", None) is None:
        config.mtp_layer_types = ["full_attention"]  # the Qwens' MTP layer: full attention (and experts if any)
    config = config.get_mtp_config()
    if config._attn_implementation not in ("eager", "sdpa"):
        config._attn_implementation = "sdpa"
    return config


def build_mtp_layer(target: Target) -> nn.Module:
    """A fresh MTP layer for ``target`` (float32, on the CPU): transformers' MtpLayer around the target's decoder
    layer and norm classes."""
    from transformers.modeling_layers import MtpLayer  # transformers' MTP support: only for this kind

    last = decoder_layers(target.model)[-1]
    layer = MtpLayer(mtp_layer_config(target), type(last), type(last.input_layernorm), 0).float()
    model = target.model.get_base_model() if hasattr(target.model, "get_base_model") else target.model
    with torch.no_grad():  # transformers leaves a module's weights to its model's init (experts start empty)
        layer.apply(model._init_weights)
    return layer


def rotary(target: Target) -> nn.Module:
    """The target's rotary embedding (an MTP layer shares it, as transformers' MtpModel does)."""
    found = getattr(decoder(target.model), "rotary_emb", None)
    if found is None:
        raise DrafttrainError(f"the target {target.name!r} has no rotary embedding an MTP layer could share")
    return found


# ---------------------------------------------------------------------------------------------- checkpoint keys

def checkpoint_keys(folder: Path) -> dict[str, Path]:
    """Every tensor name of a model folder's safetensors -> the file holding it (one file, or an index)."""
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = [folder / WEIGHTS_NAME] if (folder / WEIGHTS_NAME).is_file() else sorted(folder.glob("*.safetensors"))
    keys: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), "pt") as handle:
            keys.update(dict.fromkeys(handle.keys(), file))
    return keys


def read_tensors(keys: dict[str, Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(keys.values())):
        with safe_open(str(file), "pt") as handle:
            out.update({name: handle.get_tensor(name) for name, where in keys.items() if where == file})
    return out


def native_tensors_in(folder: Path, target: Target) -> dict[str, torch.Tensor] | None:
    """The MTP layer's tensors in a model folder (the target's own, an export), by their checkpoint keys; None when
    the folder holds none. A folder holding more than one MTP layer is refused (drafttrain trains the one that vLLM
    reuses at every draft step)."""
    family, layers = mtp_family(target), target.num_layers
    keys = checkpoint_keys(folder)
    if any(name.startswith(family.next_layer(layers)) for name in keys):
        raise DrafttrainError(f"{folder} holds more than one MTP layer: drafttrain trains one, which vLLM reuses at "
                              "every draft step")
    mine = {name: file for name, file in keys.items() if name.startswith(family.prefix(layers))
            and not name.endswith(TARGET_COPIES)}
    return read_tensors(mine) if mine else None


class _Holder(nn.Module):
    """What transformers' loader fills and its saver reads: the MTP layer as ``layers.0``, with the config whose
    conversions apply (an MtpModel's layout without the target it would hold)."""

    base_model_prefix = "model"  # never a prefix of the keys it is given

    def __init__(self, layer: nn.Module, config, conversions=None):
        super().__init__()
        self.layers = nn.ModuleList([layer])
        self.config = config
        if conversions is not None:
            self._weight_conversions = conversions


@contextlib.contextmanager
def _no_progress_bar():
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def load_native(layer: nn.Module, tensors: dict[str, torch.Tensor], target: Target, where: str) -> None:
    """Fill ``layer`` with the MTP tensors of a checkpoint (checkpoint keys), converted as transformers' MtpModel
    loads them; a key missing, left over or of another shape is an error naming ``where``."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping, get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    mapping = [WeightRenaming(source_patterns=re.escape(f"layers.{target.num_layers}."),
                              target_patterns="layers.0.mtp_block.")]
    mapping += get_checkpoint_conversion_mapping("MtpModel") + get_model_conversion_mapping(target.model)
    holder = _Holder(layer, layer.config)
    with _no_progress_bar():  # one layer loads in a blink: no bar on every checkpoint evaluation
        info, _ = convert_and_load_state_dict_in_model(holder, dict(tensors), LoadStateDictConfig(
            weight_mapping=mapping, dtype=next(layer.parameters()).dtype))
    problems = [f"missing {sorted(info.missing_keys)[:4]}" if info.missing_keys else "",
                f"not an MTP layer's {sorted(info.unexpected_keys)[:4]}" if info.unexpected_keys else "",
                f"of another shape {sorted(k for k, *_ in info.mismatched_keys)[:4]}" if info.mismatched_keys else ""]
    problems = [p for p in problems if p]
    if problems:
        raise DrafttrainError(f"{where}: the MTP weights do not fit the target's MTP layer ({'; '.join(problems)}); "
                              "a quantised checkpoint must be dequantised first")


def native_state(layer_state: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
    """An MTP layer's state (MtpLayer's own names) under the checkpoint's keys: the reverse of ``load_native``
    (experts split back one by one where the checkpoint stores them so)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, revert_weight_conversion

    family, layers = mtp_family(target), target.num_layers
    block = {family.block_prefix(layers) + name.removeprefix("mtp_block."): value
             for name, value in layer_state.items() if name.startswith("mtp_block.")}
    conversions = [t for t in get_model_conversion_mapping(target.model, add_legacy=False)
                   if not isinstance(t, PrefixChange)]  # the decoder layer's keys only: no model prefix moves
    out = revert_weight_conversion(_Holder(nn.Identity(), target.config, conversions), block) if conversions else block
    for part, name in family.parts.items():
        out[f"{family.prefix(layers)}{name}.weight"] = layer_state[f"{part}.weight"]
    return {name: value.contiguous() for name, value in out.items()}


def layer_state(native: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
    """Checkpoint-keyed MTP tensors -> MtpLayer's own names (``load_native`` into a fresh layer, read back)."""
    layer = build_mtp_layer(target)
    load_native(layer, native, target, "the MTP weights")
    return layer.state_dict()
