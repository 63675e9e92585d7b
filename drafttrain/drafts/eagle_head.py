"""What the EAGLE heads (EAGLE-1/2 and EAGLE-3) share: they read the target's hidden states and the next token,
decode autoregressively with their own small KV cache (drafttrain.drafts.layers), and are served by the ``eagle``
proposer, which drives them through ``fuse``, ``step`` and ``new_caches``."""

from __future__ import annotations

from typing import Any

import torch

from drafttrain.drafts.base import Drafter, read_draft_config
from drafttrain.drafts.layers import LayerCache, check_target_sizes, copy_target_layer
from drafttrain.targets import Target
from drafttrain.targets.hidden import decoder_layers


class EagleHead(Drafter):
    proposer = "eagle"
    layer_ids: list[int]  # the target taps the head reads (HF hidden_states numbering)

    @property
    def tap_layers(self) -> list[int]:
        """The target hidden states the proposer feeds the head at decode time, concatenated in this order."""
        return list(self.layer_ids)

    @property
    def feature_dtype(self) -> torch.dtype:
        """What the head computes in: the proposer hands it the target's hidden states in this dtype."""
        return self.fc.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.target.model.get_input_embeddings()(input_ids)

    def new_caches(self) -> list[LayerCache]:
        return [LayerCache() for _ in range(self.config.num_layers)]

    @classmethod
    def start_layers(cls, config) -> int:
        # only init_from_target's "layer" copies one: a process fed by capture engines then loads no layer at all
        return 1 if "layer" in config.init_from_target else 0

    @torch.no_grad()
    def init_from_target(self, parts: list[str]) -> "EagleHead":
        """Start from the target instead of noise (see the config's ``init_from_target``)."""
        if "layer" in parts:
            copy_target_layer(self.first_layer(), decoder_layers(self.target.model)[-1])
        if "fc" in parts:
            self.init_fc_passthrough()
        return self

    def first_layer(self):
        raise NotImplementedError

    def init_fc_passthrough(self) -> None:
        """fc such that the fused feature is the (last) target tap it reads."""
        raise NotImplementedError

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """Target taps -> the hidden input of the first draft step."""
        raise NotImplementedError

    def step(self, hidden, input_ids, position_ids, caches, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward: (hidden for the next step, logits over the TARGET vocabulary)."""
        raise NotImplementedError

    @staticmethod
    def read_checked_config(directory, target: Target, config: dict[str, Any] | None = None) -> dict[str, Any]:
        """The checkpoint's config (read here unless given), refused when the head was trained for a target of
        another shape."""
        config = config or read_draft_config(directory)
        check_target_sizes(config, target, f"the draft at {directory}: its")
        return config

    def llama_fields(self) -> dict[str, Any]:
        """The Llama-layer part of the interchange config that vLLM and SGLang build the head from."""
        c = self.layer_config
        return {
            "model_type": "llama",
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "num_hidden_layers": self.config.num_layers,
            "rms_norm_eps": c.rms_norm_eps,
            "hidden_act": c.hidden_act,
            "max_position_embeddings": c.max_position_embeddings,
            "rope_parameters": dict(c.rope_parameters),
            "rope_theta": c.rope_parameters.get("rope_theta"),
            "vocab_size": c.vocab_size,
            "tie_word_embeddings": False,
        }
