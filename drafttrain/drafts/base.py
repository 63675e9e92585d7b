"""What every draft kind is. A kind is one class (its registry entry, drafttrain.drafts.registry) that says:

* ``kind`` and ``config_class``: its name and its section of the recipe schema (drafttrain.config);
* ``build`` / ``from_pretrained``: how its module is made for a target, fresh or from a checkpoint;
* ``target_needs``: which target outputs it trains on (drafttrain.targets.outputs.TargetNeeds);
* ``trainable_target_parameters``: which target parameters it trains (none: the frozen target is the default);
* ``training_step``: its loss (built from drafttrain.drafts.losses);
* ``proposer``: the decoding proposer that serves it (drafttrain.decoding, by name);
* its codecs (drafttrain.drafts.formats, one module per kind, registered beside it): the serving formats it can
  be written in (vllm, sglang, speculators, hf), what it looks like in each, the way back (so an export loads and
  evaluates like the checkpoint it came from), and the engines that serve each. drafttrain.export writes the files.

The trainer, ``prepare``, checkpoint evaluation and the evaluator only ever talk to a kind through this class.
A draft never registers the target's weights as its own: it references the target (``attach_target``), so the
target is neither trained (unless declared) nor saved with the draft.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import save_file
from torch import nn

from drafttrain import DrafttrainError, __version__
from drafttrain.config import DraftConfig, LoraSettings
from drafttrain.data.vocab import mapping_problem
from drafttrain.drafts.codecs import writable_formats
from drafttrain.drafts.lora import has_lora, merged_state
from drafttrain.runfolder import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    FileDigest,
    RunFolder,
    damaged,
    read_json_file,
    read_safetensors,
)
from drafttrain.targets import Target
from drafttrain.targets.family import draft_layer_fields
from drafttrain.targets.outputs import TargetNeeds, TargetOutputs


@dataclasses.dataclass
class StepOutput:
    """One training step's result. ``correct[k]`` / ``counted[k]``: at draft position k+1 (an unrolled step, a
    Medusa head, a token of the draft model), how many trainable tokens the draft's top-1 got right out of how
    many it was scored on; their ratio estimates the acceptance at that position."""

    loss: torch.Tensor
    metrics: dict[str, float]  # loss parts, logged as they are (acc_k come from correct / counted)
    correct: list[float]
    counted: list[float]
    # name -> (sum, weight) of a per-token measure, which held-out evaluation adds up over rows exactly (val_<name>)
    measures: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)

    @property
    def accuracies(self) -> list[float]:
        return [c / n if n else 0.0 for c, n in zip(self.correct, self.counted)]


def simulated_tau(per_step_acc: Iterable[float]) -> float:
    """τ predicted from per-depth conditional acceptance probabilities acc_1..acc_K of a chain of K drafts.

    ``1 + Σ_k Π_{i<=k} acc_i``: the 1 is the target's own token at every step (same +1 bonus convention as
    drafttrain.evaluation.metrics.tau), and Π_{i<=k} acc_i is the probability that depth k is accepted. Feed it
    ``acceptance_per_position(...)["conditional"]`` to get back the measured τ; a None entry stops the chain.
    """
    total, survive = 1.0, 1.0
    for acc in per_step_acc:
        if acc is None:
            break
        survive *= float(acc)
        total += survive
    return total


def add_positions(total: list[float], values: list[float]) -> list[float]:
    """Element-wise sum of two per-position lists (of any lengths): pooling ``correct`` / ``counted``."""
    return [(total[i] if i < len(total) else 0.0) + (values[i] if i < len(values) else 0.0)
            for i in range(max(len(total), len(values)))]


def top1_hits(draft_ids: torch.Tensor, target_ids: torch.Tensor, weight: torch.Tensor) -> tuple[float, float]:
    """(number of positions where the draft's top-1 equals the target's, number of positions counted): a position
    counts when its weight is above 0, whatever the weight (evaluation feedback weighs the loss, not the metric)."""
    weight = (weight > 0).float()
    return float(((draft_ids == target_ids).float() * weight).sum()), float(weight.sum())


# What a draft records of the target it was trained for and compares when loaded for one (its fingerprint, with the
# target's tokenizer): the architecture, the sizes, and what a draft layer mirrors of the target's attention (heads,
# head size, epsilon, context length, RoPE: targets.family.draft_layer_fields). Drafts written before the mirrored
# ones were recorded hold the first four. (Its class names are recorded too, not compared: a draft saved with its
# target wrapped in adapters recorded the wrapper's.)
TARGET_FACTS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                "rope_parameters")
# the interchange config's flat spelling of a mirrored fact (engines read rope_theta beside rope_parameters)
_FLAT_FACTS = {"rope_theta": "rope_parameters"}


class Drafter(nn.Module):
    kind: ClassVar[str]
    config_class: ClassVar[type[DraftConfig]]
    proposer: ClassVar[str]
    description: ClassVar[str] = ""  # what it is, in a phrase (the model card's first line)
    # A continued draft (draft.init_from) may draft over a vocabulary chosen on the new data (adopt_vocabulary)
    adopts_vocabulary: ClassVar[bool] = False
    # The facts of the target it was trained for (TARGET_FACTS) that the target it serves must share: its weights
    # read that target's hidden states and mirror its layers. Its tokenizer is compared whatever the kind.
    target_facts: ClassVar[tuple[str, ...]] = TARGET_FACTS

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        self.__dict__["_target"] = None  # a plain attribute: the target must not become a submodule

    loaded_from: dict[str, str] | None = None  # {"path", "weights_sha256"} when loaded from files (load_drafter)
    trained_for: str | None = None  # the name of the target it was trained for, when loaded from files
    continued_from: dict[str, str] | None = None  # the saved draft a run continued (draft.init_from), as loaded

    def identity(self) -> dict[str, Any]:
        """What a report records of the draft it measured, so a model card's table is matched to its weights, and
        which target it was trained for (a report says so when it serves another: a fine-tune of that one)."""
        return {"kind": self.kind, **(self.loaded_from or {"path": None, "weights_sha256": None}),
                "trained_for": self.trained_for}

    # -- the target it serves ---------------------------------------------------------------------------
    def attach_target(self, target: Target) -> "Drafter":
        self.__dict__["_target"] = target
        return self

    @property
    def target(self):
        if self.__dict__["_target"] is None:
            raise RuntimeError(f"{type(self).__name__} has no target attached (call attach_target)")
        return self.__dict__["_target"]

    # -- the registry entry --------------------------------------------------------------------------------
    @classmethod
    def serves(cls, config: DraftConfig) -> bool:
        """Whether this class is the one for a draft of this section. A kind's own class serves every section of
        its kind; a variant (a subclass registered with drafttrain.drafts.registry.register_variant) serves the
        sections that select it, and the most derived variant that does is chosen."""
        return True

    @classmethod
    def build(cls, config: DraftConfig, target: Target, run: RunFolder | None = None) -> "Drafter":
        """A fresh draft for ``target`` (``run``: the run folder, for files ``prepare`` wrote there)."""
        raise NotImplementedError

    @classmethod
    def from_pretrained(cls, directory: Path, target: Target, config: dict[str, Any] | None = None) -> "Drafter":
        """The draft saved in ``directory`` for ``target``; ``config``: its config.json when the caller has read it
        already (a saved draft is read once: drafts/saved.py)."""
        raise NotImplementedError

    @classmethod
    def target_needs(cls, config: DraftConfig, target: Target) -> TargetNeeds:
        """What it trains on, known from the recipe and the target alone (prepare asks before any draft exists)."""
        raise NotImplementedError

    @classmethod
    def start_layers(cls, config: DraftConfig) -> int:
        """How many of the target's last decoder layers ``build`` may copy (init_from_target): under ZeRO-3 these are
        gathered whole while the draft is built."""
        return 1

    @classmethod
    def max_draft_depth(cls, config: DraftConfig) -> int | None:
        """The deepest draft it can propose (None: any)."""
        return None

    def needs(self) -> TargetNeeds:
        return self.target_needs(self.config, self.target)

    def adopt_vocabulary(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Draft over another draft vocabulary (``d2t``/``t2d``, drafttrain.data.vocab): a continued draft adapting
        to data its own vocabulary covers poorly. Kinds that can set ``adopts_vocabulary``."""
        raise DrafttrainError(f"a {self.kind} draft keeps the draft vocabulary it was trained with")

    def held_out_needs(self) -> TargetNeeds:
        """What held-out evaluation runs the target for: what training needs, unless a measure needs more."""
        return self.needs()

    adapts_target = False  # True when loading the draft changed the target (adapters): see original_target()

    def original_target(self):
        """A context in which the target computes as the original (for drafts that adapt it)."""
        return contextlib.nullcontext()

    def card_notes(self) -> list[str]:
        """What a user serving it must know beyond the engine's command (the model card's "Serve it")."""
        return []

    def trainable_target_parameters(self) -> list[str]:
        """Names (in ``target.model``) of the target parameters this draft trains; none by default."""
        return []

    def target_learning(self) -> tuple[float | None, int]:
        """(learning rate of the target parameters it trains, None: training.learning_rate; the optimizer step
        from which they train: before it only the draft's own parameters learn)."""
        return None, 0

    def own_step_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[dict, TargetOutputs] | None:
        """Rows a training step should learn from instead of the loader's ``batch`` (a kind that trains on its own
        samples), with the target's outputs for them; None (here): the loader's batch and the trainer's outputs.
        Asked before the target runs, so that the target runs once per micro-batch, on the rows that train."""
        return None

    def training_step(self, batch: dict[str, torch.Tensor], outputs: TargetOutputs) -> StepOutput:
        raise NotImplementedError

    # -- save / load ---------------------------------------------------------------------------------------
    def interchange_config(self) -> dict[str, Any]:
        """The config.json that serving engines read (HF style)."""
        raise NotImplementedError

    def save_pretrained(self, directory: str | Path, **meta) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.state_tensors(), str(directory / WEIGHTS_NAME), metadata={"format": "pt", "kind": self.kind})
        (directory / CONFIG_NAME).write_text(json.dumps(self.checkpoint_config(**meta), indent=2))
        return directory

    # -- export -------------------------------------------------------------------------------------------
    def export_formats(self) -> tuple[str, ...]:
        """The formats this draft, as configured, is written in, the one it prefers first (its codecs')."""
        return writable_formats(self)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The weights as the kind's checkpoint holds them (draft LoRA adapters merged into their layers)."""
        state = merged_state(self) if has_lora(self) else self.state_dict()
        return {k: v.detach().contiguous().cpu() for k, v in state.items()}

    def checkpoint_config(self, **meta) -> dict[str, Any]:
        """config.json of a checkpoint: the interchange config and the ``drafttrain`` section."""
        config = self.interchange_config()
        config["drafttrain"] = {"kind": self.kind, "version": __version__,
                                "draft": self.config.model_dump(mode="json"), "target": target_identity(self.target),
                                **({"continued_from": self.continued_from} if self.continued_from else {}), **meta}
        return config

    def load_weights(self, directory: str | Path) -> None:
        path = Path(directory) / WEIGHTS_NAME
        state, _ = read_safetensors(path)
        try:
            missing, unexpected = self.load_state_dict(state, strict=False)
        except RuntimeError as err:  # shapes that disagree with the config (an edited size, another draft)
            raise damaged(path, f"does not fit the {self.kind} draft its config.json describes "
                                f"({str(err).splitlines()[-1].strip()[:200]})") from None
        if missing or unexpected:
            raise damaged(path, f"does not match a {self.kind} draft: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def check_vocabulary(self, directory: str | Path) -> None:
        """A draft vocabulary's maps (d2t, t2d buffers) must describe one vocabulary of the target's, whoever wrote
        them: a map past the target's vocabulary, or a t2d that disagrees with d2t, trains and drafts wrong tokens."""
        d2t, t2d = getattr(self, "d2t", None), getattr(self, "t2d", None)
        if isinstance(d2t, torch.Tensor) and isinstance(t2d, torch.Tensor):
            problem = mapping_problem(d2t, t2d, self.target.vocab_size)
            if problem is not None:
                raise damaged(Path(directory) / WEIGHTS_NAME, f"holds a draft vocabulary the target "
                                                              f"{self.target.name!r} cannot use: {problem}")

    def check_finite(self, directory: str | Path) -> None:
        """Refuse weights that hold NaN or inf (a damaged file, or training that diverged)."""
        bad = [name for name, t in self.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
        if bad:
            raise damaged(Path(directory) / WEIGHTS_NAME, f"holds non-finite weights (NaN or inf) in {bad[:5]}")


def with_lora(model: nn.Module, lora: LoraSettings, owner: str, field: str) -> nn.Module:
    """``model`` wrapped in peft LoRA adapters on ``lora.target_modules`` (rank, alpha, dropout from ``lora``);
    module names the model lacks are refused, naming the recipe's ``field``, ``owner`` and some names it has."""
    from peft import LoraConfig, get_peft_model  # peft imports in seconds: only for LoRA sections

    present = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    missing = [m for m in lora.target_modules if m not in present]
    if missing:
        examples = sorted(n for n in present if n and not n.isdigit())[:12]
        raise DrafttrainError(f"{field}.target_modules {missing} are not modules of {owner} (it has e.g. "
                              f"{', '.join(examples)})")
    return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                            target_modules=list(lora.target_modules), bias="none"))


def target_identity(target: Target) -> dict[str, Any]:
    """What a draft records of the target it was trained for (TARGET_FACTS, its name and its tokenizer), so it is
    never served by another."""
    config = target.model.config
    model = target.model.get_base_model() if hasattr(target.model, "get_base_model") else target.model  # unwrapped
    try:
        mirrored = draft_layer_fields(config)
    except AttributeError:  # a family without attention heads to mirror: its sizes alone are recorded
        mirrored = {}
    facts = {"model_type": getattr(config, "model_type", None), "vocab_size": target.vocab_size,
             "hidden_size": target.hidden_size, "num_hidden_layers": target.num_layers,
             **{name: mirrored[name] for name in TARGET_FACTS if name in mirrored and name != "vocab_size"}}
    return {"name": target.name, "architectures": list(getattr(config, "architectures", None) or [type(model).__name__]),
            **facts, "tokenizer": target.tokenizer_fingerprint}


def check_target(config: dict[str, Any], target: Target, directory: Path, facts: tuple[str, ...] = TARGET_FACTS) \
        -> None:
    """A draft trained for another target is refused, naming what differs: another tokenizer (even at the same
    vocabulary size), or any of ``facts`` (the kind's ``target_facts``) the draft recorded of the target it was trained
    for. Not damage: the draft is sound, the target is another (a fine-tune of the same model differs in none)."""
    record = config["drafttrain"].get("target") or {}
    current = target_identity(target)
    if record.get("tokenizer") and current["tokenizer"] and record["tokenizer"] != current["tokenizer"]:
        raise DrafttrainError(
            f"the draft at {directory} was trained for a target with another tokenizer (fingerprint "
            f"{record['tokenizer']}; {target.name!r} has {current['tokenizer']}): its token ids would mean other "
            "tokens. Serve it with the target it was trained for"
        )
    differ = [line for name in facts if name in record for line in _differences(name, record[name], current.get(name))]
    if differ:
        raise DrafttrainError(
            f"the draft at {directory} was trained for target {record.get('name')!r}, given {target.name!r}, which "
            f"differs: {'; '.join(differ)}. The draft is sound: serve it with the target it was trained for (or a "
            "fine-tune of it), or train one for this target"
        )


def unrecorded_fact(drafter: "Drafter", key: str, config: dict[str, Any]) -> str | None:
    """The fact of its target that config.json's ``key`` mirrors when the draft's record of that target lacks it (a
    draft written before the fact was recorded): then a value that differs from the draft built for this target
    may say another target as well as an edited file. None: a fact recorded, or none of the target's."""
    fact = _FLAT_FACTS.get(key, key)
    record = config["drafttrain"].get("target") or {}
    return fact if fact in drafter.target_facts and fact not in record else None


def _differences(name: str, trained: Any, given: Any) -> list[str]:
    """'NAME TRAINED trained for, GIVEN given' for a fact that differs; a dict (RoPE) key by key."""
    if isinstance(trained, dict) and isinstance(given, dict):
        return [line for key in sorted(trained.keys() | given.keys())
                for line in _differences(f"{name}.{key}", trained.get(key), given.get(key))]
    if trained == given or (isinstance(trained, list) and isinstance(given, tuple) and trained == list(given)):
        return []
    return [f"{name} {trained!r} trained for, {given!r} given"]


def saved_section(config_class: type[DraftConfig], config: dict[str, Any]) -> DraftConfig:
    """The draft section a saved draft's config.json holds (read in today's names, whichever drafttrain saved it)."""
    return config_class.from_saved(config["drafttrain"]["draft"])


def read_draft_config(directory: str | Path) -> dict[str, Any]:
    return read_draft_config_file(directory)[0]


def read_draft_config_file(directory: str | Path) -> tuple[dict[str, Any], FileDigest]:
    """A draft's config.json, read once: its value and the digest of the bytes it came from."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise DrafttrainError(f"no draft checkpoint at {directory}: {CONFIG_NAME} is missing")
    config, digest = read_json_file(path)
    if not isinstance(config, dict) or not isinstance(config.get("drafttrain"), dict) \
            or "kind" not in config["drafttrain"]:
        raise damaged(path, "has no 'drafttrain' section with the draft's kind: not a checkpoint written by drafttrain")
    return config, digest
