"""A target without its decoder layers: what a process needs of a target whose forward runs elsewhere (a capture
engine streaming its hidden states to trainers).

Such a process still reads the target's embeddings (drafts embed tokens with them), its final norm (the engine
gives the final state before it) and its lm_head (logits are recomputed from the final state): everything outside
the decoder layers, read by name from the checkpoint's safetensors, a few GB at most where the layers are hundreds.
Each decoder layer is replaced by a stub without weights that refuses to run, so a path that would need the layers
fails with one line instead of computing with empty ones; ``keep`` names layers to load whole (a draft initialised
from the target's last layers)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from drafttrain import DrafttrainError
from drafttrain.config import TargetConfig
from drafttrain.targets.hidden import decoder_layers
from drafttrain.targets.loading import _DTYPES, Target, load_tokenizer, resolve_model_dir, target_config, target_name

INDEX = "model.safetensors.index.json"


class AbsentLayer(torch.nn.Module):
    """A decoder layer this process does not hold: it runs in the engine that captures the target's states."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise DrafttrainError(f"this process holds the target's embeddings, final norm and lm_head only (its layers "
                              f"run in the capture engine): decoder layer {self.index} cannot run here")


def load_head(cfg: TargetConfig | str, keep: tuple[int, ...] = ()) -> Target:
    """The target with every decoder layer but ``keep`` left out (see the module docstring)."""
    cfg = target_config(cfg) if isinstance(cfg, str) else cfg
    if cfg.adapter is not None:
        raise DrafttrainError(f"{cfg.model}+{cfg.adapter}: a target whose layers run in an engine is given merged "
                              "(peft's merge_and_unload, then save_pretrained), as the engine serves it")
    folder = Path(resolve_model_dir(cfg.model))
    if not folder.is_dir():
        raise DrafttrainError(f"target {cfg.model!r}: a process holding only the target's head reads it from a local "
                              "folder (download it once, e.g. `huggingface-cli download`, and give the folder)")
    config = AutoConfig.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code)
    dtype = _DTYPES[cfg.dtype] if cfg.dtype != "auto" else getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = _empty_model(config, cfg.trust_remote_code, include_buffers=False).to(dtype)
    layers = decoder_layers(model)
    for i in range(len(layers)):
        if i not in keep:
            layers[i] = AbsentLayer(i)
    _load_weights(model, folder, dtype)
    if getattr(config.get_text_config(decoder=True), "tie_word_embeddings", False):
        model.tie_weights()
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise DrafttrainError(f"target {cfg.model!r}: {folder} holds no weights for {', '.join(missing[:4])}"
                              f"{' ...' if len(missing) > 4 else ''}")
    model.eval().requires_grad_(False)
    return Target(name=target_name(cfg), model=model, tokenizer=load_tokenizer(cfg), source_dir=folder)


def _checkpoint_keys(folder: Path) -> dict[str, Path]:
    """Every weight name of the folder's safetensors, with the file that holds it."""
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DrafttrainError(f"{folder} holds no safetensors weights")
    keys = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            keys.update(dict.fromkeys(handle.keys(), file))
    return keys


def _key_for(name: str, keys: dict[str, Path]) -> str | None:
    """The checkpoint's name for parameter ``name``: the same, or the one name that ends like it (checkpoints of
    multimodal models prefix the text model's weights)."""
    if name in keys:
        return name
    tail = name.split(".", 1)[1] if name.startswith("model.") else name
    found = [k for k in keys if k.endswith("." + tail) or k.endswith("." + name)]
    return found[0] if len(found) == 1 else None


def _load_weights(model: torch.nn.Module, folder: Path, dtype: torch.dtype) -> None:
    keys = _checkpoint_keys(folder)
    wanted = {name: _key_for(name, keys) for name, p in model.named_parameters() if p.is_meta}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, key in wanted.items():
        if key is not None:
            by_file.setdefault(keys[key], []).append((name, key))
    for file, pairs in by_file.items():
        with safe_open(str(file), framework="pt") as handle:
            for name, key in pairs:
                set_module_tensor_to_device(model, name, "cpu", value=handle.get_tensor(key).to(dtype))


def load_shape(cfg: TargetConfig | str) -> Target:
    """The target's shape alone (its config on the meta device, no weights, no tokenizer): what is known of it
    before any weight is read, such as which layers a draft kind taps."""
    cfg = target_config(cfg) if isinstance(cfg, str) else cfg
    folder = resolve_model_dir(cfg.model)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code)
    model = _empty_model(config, cfg.trust_remote_code, include_buffers=True)
    return Target(name=target_name(cfg), model=model.eval().requires_grad_(False), tokenizer=None)


def _empty_model(config, trust_remote_code: bool, include_buffers: bool) -> torch.nn.Module:
    """The causal LM of ``config`` with its weights on the meta device (and its buffers too, with
    ``include_buffers``), built by its class directly: under a ZeRO-3 launch ``from_config`` would partition it
    (zero.Init), which a model without weights cannot be."""
    with init_empty_weights(include_buffers=include_buffers):
        if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
            return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)  # the model's own code
