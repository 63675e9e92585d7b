"""Medusa's serving format: vLLM's Medusa layout (heads over the full vocabulary), with a Medusa-2 draft's adapted
target, merged, beside it; and Medusa heads as vLLM reads them from other tools (FasterDecoding's layout too)."""

from __future__ import annotations

import torch

from drafttrain import DrafttrainError
from drafttrain.config import MedusaConfig
from drafttrain.drafts.codecs import Codec, Exported, ForeignReader
from drafttrain.drafts.layers import check_target_sizes, foreign_tensors
from drafttrain.drafts.medusa import MedusaDrafter, save_merged
from drafttrain.targets import Target

MERGED_TARGET = "target"  # an export's adapted target, merged


class Vllm(Codec):
    fmt = "vllm"
    engines = {"vllm": "medusa"}

    def write(self, drafter: MedusaDrafter) -> Exported:
        """vLLM's Medusa layout is the checkpoint's (heads over the full vocabulary). A Medusa-2 draft brings its
        adapted target, merged, in ``target/``: it is the model to serve, since the heads were trained on its hidden
        states."""
        if drafter.d2t.numel() < drafter.t2d.numel():
            # vLLM documents a token_map for this, but builds the heads at the full vocabulary and then refuses the
            # mapped rows (vllm/model_executor/models/medusa.py, 0.32): no exact export exists
            raise DrafttrainError(
                f"these Medusa heads predict over a draft vocabulary of {drafter.d2t.numel()} tokens, which vLLM 0.32 "
                "cannot load (its Medusa heads are built at the full vocabulary and a token_map is refused at "
                "load). Train Medusa heads for vLLM with draft_vocab.enabled: false")
        config = drafter.checkpoint_config(export={"format": self.fmt})
        tensors = {k: v for k, v in drafter.state_tensors().items() if k not in ("d2t", "t2d")}
        if not drafter.adapts_target:
            return Exported(config, tensors)
        return Exported(config, tensors, folders={MERGED_TARGET: lambda folder: save_merged(drafter.target, folder)},
                        notes=[f"Medusa-2: serve the adapted target in {MERGED_TARGET}/ (merged LoRA) with these heads"],
                        files=[f"- `{MERGED_TARGET}/`: the adapted target (LoRA merged), with its tokenizer"])

    def read(self, config, tensors):
        vocab = config["vocab_size"]  # heads over the full vocabulary: draft id == target id
        return config, {**tensors, "d2t": torch.zeros(vocab, dtype=torch.long), "t2d": torch.ones(vocab, dtype=torch.bool)}


class VllmLayout(ForeignReader):
    """Medusa heads as vLLM 0.32 reads them (vllm/model_executor/models/medusa.py and its MedusaConfig): the head
    and layer counts under any key vLLM renames (FasterDecoding's ``medusa_num_heads`` too), names with or without
    ``medusa_heads.`` and in FasterDecoding's numbered layout, block biases only with ``medusa_fc_bias`` (vLLM's
    default: none), one shared lm_head with ``original_lm_head``, and a ``token_map`` for a ``truncated_vocab_size``
    below the vocabulary."""

    fmt = "vllm"

    def recognises(self, config) -> bool:
        return config.get("model_type") == "medusa"

    def read_foreign(self, config, tensors, target: Target):
        check_target_sizes(config, target, "the heads'")
        if config.get("logit_scale", 1.0) != 1.0:
            raise DrafttrainError(f"the heads set logit_scale {config['logit_scale']}, which drafttrain's heads do not "
                                  "apply")
        heads, layers = vllm_medusa_counts(config)
        named = foreign_tensors({vllm_medusa_name(k): v for k, v in tensors.items()})
        token_map = named.pop("token_map", None)
        d2t, t2d, order = foreign_vocab(token_map, config.get("truncated_vocab_size"), target.vocab_size)
        bias, shared = bool(config.get("medusa_fc_bias", False)), bool(config.get("original_lm_head"))
        if order is not None and not shared:
            raise DrafttrainError("the heads have a token_map but one lm_head each: vLLM 0.32 builds those at the whole "
                                  "vocabulary and cannot load them cut to the map (only original_lm_head is cut)")
        out = {}
        for h in range(heads):
            for index in range(layers):
                key = f"blocks.{h}.layers.{index}."
                out[key + "weight"] = named.pop(key + "weight")
                out[key + "bias"] = named.pop(key + "bias") if bias else torch.zeros(config["hidden_size"])
            out[f"lm_heads.{h}.weight"] = _head_rows(named, h, shared, token_map, order)
        for name in ("lm_head.weight", "lm_heads.0.weight") if shared else ():
            named.pop(name, None)
        if named:
            hint = " (block biases: set medusa_fc_bias true if they were trained with them)" \
                if not bias and any(k.endswith(".bias") for k in named) else ""
            raise DrafttrainError(f"the heads hold weights that vLLM would not load with this config: "
                                  f"{sorted(named)[:5]}{hint}")
        n = int(d2t.numel())
        notes = [] if bias else ["vLLM's Medusa blocks have no bias unless medusa_fc_bias is set: drafttrain's have "
                                 "one, set to zero (the same computation)"]
        return (MedusaConfig(num_heads=heads, num_layers=layers),
                {**config, "truncated_vocab_size": n if n < target.vocab_size else None},
                {**out, "d2t": d2t, "t2d": t2d}, notes)


def vllm_medusa_counts(config: dict) -> tuple[int, int]:
    """(heads, layers per head) as vLLM's MedusaConfig.from_pretrained reads them: in the file's order, every key
    with "num" and "heads" in it is renamed num_heads, and "num" and "layers" num_hidden_layers, the last one
    winning (FasterDecoding's ``medusa_num_heads`` so becomes the count); its defaults otherwise (5 heads, 1 layer)."""
    renamed = dict(config)
    for key in list(config):
        if "num" in key and ("heads" in key or "layers" in key):
            renamed["num_heads" if "heads" in key else "num_hidden_layers"] = renamed.pop(key)
    return int(renamed.get("num_heads", 5)), int(renamed.get("num_hidden_layers", 1))


def _head_rows(named: dict[str, torch.Tensor], h: int, shared: bool, token_map, order) -> torch.Tensor:
    """Head h's lm_head in drafttrain's draft-id order: its own, or the one shared lm_head (vLLM reads it as
    ``lm_head.weight`` or ``lm_heads.0.weight``), its rows taken by token_map when it covers the whole vocabulary."""
    lm_head = (named.get("lm_head.weight", named.get("lm_heads.0.weight")) if shared
               else named.pop(f"lm_heads.{h}.weight"))
    if lm_head is None:
        raise KeyError("lm_head.weight")
    if order is None:
        return lm_head
    return (lm_head[token_map] if lm_head.shape[0] > token_map.numel() else lm_head)[order]


def vllm_medusa_name(name: str) -> str:
    """A weight's name as vLLM's Medusa loader maps it: ``medusa_heads.`` dropped, FasterDecoding's numbered names
    (``{head}.{layer}.linear.weight``, ``{head}.{layers}.weight``) to ``blocks.*`` and ``lm_heads.*``."""
    name = name.replace("medusa_heads.", "")
    parts = name.split(".")
    if len(parts) >= 3 and parts[0].isdigit() and parts[1].isdigit():
        rest = parts[2:]
        if "linear" in rest:
            return f"blocks.{parts[0]}.layers.{parts[1]}." + ".".join(rest[rest.index("linear") + 1:])
        return f"lm_heads.{parts[0]}." + ".".join(rest)
    return name


def foreign_vocab(token_map: torch.Tensor | None, truncated: int | None, vocab: int):
    """(d2t, t2d, order) of heads over vLLM's ``token_map`` (their rows in its order; ``order`` sorts them into
    drafttrain's draft-id order), or over the whole vocabulary (order None)."""
    truncated = truncated or vocab
    if truncated >= vocab:  # vLLM ignores a token_map then
        return torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool), None
    if token_map is None or token_map.numel() != truncated or token_map.unique().numel() != truncated \
            or int(token_map.min()) < 0 or int(token_map.max()) >= vocab:
        raise DrafttrainError(f"truncated_vocab_size is {truncated}, but the heads hold no token_map of as many distinct "
                              f"token ids below {vocab} (vLLM needs one to load them)")
    ids, order = token_map.long().sort()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(truncated), t2d, order


MEDUSA_CODECS = [Vllm()]
MEDUSA_READERS = [VllmLayout()]
