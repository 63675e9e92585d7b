"""What every draft head shares: target attachment, the training-step contract, save/load.

A head never registers the target's weights (embedding, lm_head) as its own: they stay frozen, are not in the
optimizer and are not saved, matching the EAGLE interchange layout that vLLM and SGLang load.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from drafttrain import DrafttrainError, __version__
from drafttrain.config import DraftConfig

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


@dataclasses.dataclass
class TargetFeatures:
    """What a head learns from: the target's tapped hidden states and its next-token logits."""

    hidden: torch.Tensor  # (B, T, F): the draft's taps, concatenated in draft.target_layers order
    logits: torch.Tensor  # (B, T, V)


@dataclasses.dataclass
class StepOutput:
    loss: torch.Tensor
    metrics: dict[str, float]
    step_accuracies: list[float]  # per unrolled step: P(draft argmax == target argmax) on trainable tokens


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded with zeros at the end back to x's length (dim 1)."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1) if n < x.shape[1] else torch.zeros_like(x)


def soft_cross_entropy(logits: torch.Tensor, target_p: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Mean over weighted positions of -Σ p log q."""
    per_pos = -(target_p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
    return (per_pos * weight).sum() / weight.sum().clamp(min=1)


class DraftHead(nn.Module):
    kind: ClassVar[str]
    config_class: ClassVar[type[DraftConfig]]

    def __init__(self):
        super().__init__()
        self.__dict__["_target"] = None  # plain attribute: the target must not become a submodule

    # -- target -------------------------------------------------------------------------------------------
    def attach_target(self, target) -> "DraftHead":
        self.__dict__["_target"] = target
        return self

    @property
    def target(self):
        if self.__dict__["_target"] is None:
            raise RuntimeError(f"{type(self).__name__} has no target attached (call attach_target)")
        return self.__dict__["_target"]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.target.model.get_input_embeddings()(input_ids)

    @property
    def target_layers(self) -> list[int]:
        return list(self.layer_ids)

    # -- contract ----------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, torch.Tensor], features: TargetFeatures) -> StepOutput:
        raise NotImplementedError

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """Target taps -> the hidden input of the first draft step."""
        raise NotImplementedError

    def step(self, hidden, input_ids, position_ids, caches, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward: (hidden for the next step, logits over the TARGET vocab)."""
        raise NotImplementedError

    def new_caches(self) -> list:
        raise NotImplementedError

    def interchange_config(self) -> dict[str, Any]:
        """The config.json that serving engines read (HF style)."""
        raise NotImplementedError

    def llama_fields(self) -> dict[str, Any]:
        """The Llama-layer part of the interchange config, shared by every head built from ``layer_config``."""
        c = self.layer_config
        return {
            "model_type": "llama",
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "num_hidden_layers": self.draft_config.num_layers,
            "rms_norm_eps": c.rms_norm_eps,
            "hidden_act": c.hidden_act,
            "max_position_embeddings": c.max_position_embeddings,
            "rope_parameters": dict(c.rope_parameters),
            "rope_theta": c.rope_parameters.get("rope_theta"),
            "vocab_size": c.vocab_size,
            "tie_word_embeddings": False,
        }

    # -- save / load -------------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path, draft_config: DraftConfig | None = None, **meta) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt", "kind": self.kind})
        config = self.interchange_config()
        config["drafttrain"] = {
            "kind": self.kind,
            "version": __version__,
            "draft": (draft_config or self.draft_config).model_dump(mode="json"),
            **meta,
        }
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2))
        return directory

    def load_weights(self, directory: str | Path) -> None:
        path = Path(directory) / WEIGHTS_NAME
        try:
            state = load_file(str(path))
        except Exception as err:  # noqa: BLE001 - safetensors raises several types for corrupt files
            raise DrafttrainError(f"cannot read draft weights {path}: {err}") from None
        missing, unexpected = self.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise DrafttrainError(
                f"draft weights {path} do not match a {self.kind} head: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )


def read_draft_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise DrafttrainError(f"no draft checkpoint at {directory}: {CONFIG_NAME} is missing")
    config = json.loads(path.read_text())
    if "drafttrain" not in config:
        raise DrafttrainError(f"{path} has no 'drafttrain' section: not a checkpoint written by drafttrain")
    return config
