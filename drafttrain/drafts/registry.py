"""The draft kinds: one line each. A kind's class says everything about it (drafttrain.drafts.base.Drafter)."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from drafttrain import DrafttrainError
from drafttrain.config import DraftConfig, Section, register_draft_section, unregister_draft_section
from drafttrain.data.vocab import draft_ids, draft_vocab_for
from drafttrain.drafts.base import Drafter, check_target, read_draft_config, saved_section, unrecorded_fact
from drafttrain.drafts.codecs import Codec, ForeignReader, codecs_of, readers_of, register_codecs, unregister_codecs
from drafttrain.drafts.dflash import DFlashDrafter
from drafttrain.drafts.draft_model import DraftModelDrafter
from drafttrain.drafts.eagle import EagleDrafter
from drafttrain.drafts.eagle3 import Eagle3Drafter
from drafttrain.drafts.formats import dflash as dflash_formats
from drafttrain.drafts.formats import draft_model as draft_model_formats
from drafttrain.drafts.formats import eagle as eagle_formats
from drafttrain.drafts.formats import eagle3 as eagle3_formats
from drafttrain.drafts.formats import medusa as medusa_formats
from drafttrain.drafts.lora import add_draft_lora
from drafttrain.drafts.medusa import MedusaDrafter
from drafttrain.drafts.pard import PardDrafter
from drafttrain.drafts.peagle import PEagleDrafter
from drafttrain.runfolder import (
    CONFIG_NAME,
    MANIFEST,
    WEIGHTS_NAME,
    RunFolder,
    damaged,
    drafttrain_checkpoint,
    file_sha256,
    find_draft,
    read_json,
    read_safetensors,
    verify_manifest,
)
from drafttrain.targets import Target
from drafttrain.targets.outputs import TargetNeeds

KINDS: dict[str, type[Drafter]] = {}
VARIANTS: dict[str, list[type[Drafter]]] = {}  # kind -> its variants, subclasses of its class


def register_kind(cls: type[Drafter], variants: tuple[type[Drafter], ...] = ()) -> type[Drafter]:
    """Add a kind: its class (a Drafter subclass saying everything about it) under its name, its section to the
    recipe schema, and its variants. Every stage then finds it here; its formats, through its codecs
    (drafttrain.drafts.codecs)."""
    if KINDS.get(cls.kind, cls) is not cls:
        raise DrafttrainError(f"draft kind {cls.kind!r} is registered already ({KINDS[cls.kind].__name__})")
    register_draft_section(cls.config_class)
    KINDS[cls.kind] = cls
    for variant in variants:
        register_variant(variant)
    return cls


def register_variant(cls: type[Drafter]) -> type[Drafter]:
    """Add a variant of a registered kind: a subclass of the kind's class that serves the sections its ``serves``
    selects (the kind's name, section, proposer and formats stay the kind's unless it overrides them)."""
    base = KINDS.get(cls.kind)
    if base is None or not issubclass(cls, base) or cls is base:
        raise DrafttrainError(f"{cls.__name__} is not a subclass of a registered kind's class")
    if cls not in VARIANTS.setdefault(cls.kind, []):
        VARIANTS[cls.kind].append(cls)
    return cls


def unregister_kind(kind: str) -> None:
    """Remove a kind, its variants, their codecs and its recipe section (a kind that lives for a while only, as a
    test's toy)."""
    cls = KINDS.pop(kind, None)
    for variant in VARIANTS.pop(kind, []):
        unregister_codecs(variant)
    if cls is not None:
        unregister_codecs(cls)
        unregister_draft_section(cls.config_class)


def unregister_variant(cls: type[Drafter]) -> None:
    if cls in VARIANTS.get(cls.kind, []):
        VARIANTS[cls.kind].remove(cls)


def drafter_for(config: DraftConfig) -> type[Drafter]:
    """The class of a draft of this section: the most derived registered variant of its kind that serves it, else
    the kind's own class."""
    base = drafter_class(config.kind)
    serving = [variant for variant in VARIANTS.get(config.kind, []) if variant.serves(config)]
    return max(serving, key=lambda variant: len(variant.__mro__), default=base)


@dataclasses.dataclass(frozen=True)
class BuiltinKind:
    """A kind drafttrain ships: its class (which names its recipe section and its proposer), its variants, and for
    each of these classes whose formats are codecs, its codecs and the other tools' formats it reads."""

    drafter: type[Drafter]
    variants: tuple[type[Drafter], ...] = ()
    codecs: tuple[tuple[type[Drafter], list[Codec], list[ForeignReader]], ...] = ()

    def register(self) -> None:
        register_kind(self.drafter, self.variants)
        for cls, codecs, readers in self.codecs:
            register_codecs(cls, codecs, readers)


# Every built-in kind, in one list. Their proposers (the decoding layer, above this one) register under the names
# the classes give.
BUILTIN_KINDS = (
    BuiltinKind(Eagle3Drafter, (PEagleDrafter,),
                ((Eagle3Drafter, eagle3_formats.EAGLE3_CODECS, eagle3_formats.EAGLE3_READERS),
                 (PEagleDrafter, eagle3_formats.PEAGLE_CODECS, eagle3_formats.EAGLE3_READERS))),
    BuiltinKind(EagleDrafter, (), ((EagleDrafter, eagle_formats.EAGLE_CODECS, eagle_formats.EAGLE_READERS),)),
    BuiltinKind(MedusaDrafter, (), ((MedusaDrafter, medusa_formats.MEDUSA_CODECS, medusa_formats.MEDUSA_READERS),)),
    BuiltinKind(DraftModelDrafter, (PardDrafter,),
                ((DraftModelDrafter, draft_model_formats.DRAFT_MODEL_CODECS, []),
                 (PardDrafter, draft_model_formats.PARD_CODECS, []))),
    BuiltinKind(DFlashDrafter, (), ((DFlashDrafter, dflash_formats.DFLASH_CODECS, dflash_formats.DFLASH_READERS),)),
)
for _builtin in BUILTIN_KINDS:
    _builtin.register()


def known_formats() -> tuple[str, ...]:
    """Every format a registered kind or variant is written in."""
    classes = [cls for kind, base in KINDS.items() for cls in (base, *VARIANTS.get(kind, []))]
    return tuple(dict.fromkeys(fmt for cls in classes for fmt in codecs_of(cls)))


def formats_by_kind() -> str:
    """Which serving formats each kind is written in, as help texts say it ("eagle3: vllm, sglang; ...")."""
    return "; ".join(f"{kind}: {', '.join(codecs_of(cls))}" for kind, cls in KINDS.items())


def drafter_class(kind: str) -> type[Drafter]:
    if kind not in KINDS:
        raise DrafttrainError(f"unknown draft kind {kind!r}; known kinds: {', '.join(sorted(KINDS))}")
    return KINDS[kind]


@dataclasses.dataclass(frozen=True)
class SavedDraft:
    """A saved draft (a checkpoint, a run's best, an export, an import), found and read once: its folder, its
    config.json and its kind's class. Pass it on instead of its path, so nothing finds and reads it again."""

    directory: Path
    config: dict
    kind: type[Drafter]

    @classmethod
    def find(cls, path: str | Path | SavedDraft) -> SavedDraft | None:
        """The draft at ``path`` when drafttrain saved one there (a checkpoint, its run or checkpoints folder), else
        None (a plain model folder, a built-in name, a Hub id); a damaged one is refused naming its file."""
        if isinstance(path, SavedDraft):
            return path
        directory = drafttrain_checkpoint(path)
        return None if directory is None else cls._read(directory)

    @classmethod
    def open(cls, path: str | Path | SavedDraft) -> SavedDraft:
        return path if isinstance(path, SavedDraft) else cls._read(find_draft(path))

    @classmethod
    def _read(cls, directory: Path) -> SavedDraft:
        config = read_draft_config(directory)
        kind = config["drafttrain"]["kind"]
        if kind not in KINDS:
            raise damaged(directory / CONFIG_NAME, f"names draft kind {kind!r}, which is not one of {', '.join(KINDS)}")
        return cls(directory, config, KINDS[kind])

    @property
    def target_name(self) -> str | None:
        """The target it was trained for: recorded in its config, or (older checkpoints) in its manifest's recipe."""
        named = (self.config["drafttrain"].get("target") or {}).get("name")
        if named is None and (self.directory / MANIFEST).is_file():
            recipe = read_json(self.directory / MANIFEST).get("built_from", {}).get("recipe") or {}
            named = (recipe.get("target") or {}).get("model")
        return named

    def section(self) -> DraftConfig:
        """Its draft section, validated; one that is missing or invalid is refused as damage, naming the file."""
        try:
            return saved_section(self.kind.config_class, self.config)
        except KeyError as err:
            raise damaged(self.directory / CONFIG_NAME, f"holds no {self.kind.kind} section ({err})") from None
        except ValidationError as err:
            raise damaged(self.directory / CONFIG_NAME, f"holds an invalid {self.kind.kind} section "
                                                        f"({err.errors()[0]['msg']})") from None

    def max_depth(self) -> int | None:
        """The deepest draft it can propose; None: any."""
        section = self.section()
        return drafter_for(section).max_draft_depth(section)


def build_drafter(config: DraftConfig, target: Target, run: RunFolder | None = None) -> Drafter:
    """A fresh draft of the recipe's kind (or the variant its section selects) for ``target`` (``run``: the run
    folder prepare wrote)."""
    cls = drafter_class(config.kind)
    if not isinstance(config, cls.config_class):
        raise DrafttrainError(f"a {config.kind} draft is built from a {cls.config_class.__name__} section, not a "
                              f"{type(config).__name__}")
    return drafter_for(config).build(config, target, run)


def start_drafter(config: DraftConfig, target: Target, run: RunFolder | None = None, new_vocabulary: bool = False) -> Drafter:
    """The draft a training run starts from: a fresh one of the recipe's kind, or the saved one ``init_from``
    names, continued (over the run's own draft vocabulary when ``new_vocabulary``: draft_vocab.enabled); with
    ``draft_lora``, wrapped in LoRA adapters that alone train."""
    if config.init_from is None:
        drafter = build_drafter(config, target, run)
    else:
        drafter = continued_drafter(config, target)
        if new_vocabulary:
            drafter.adopt_vocabulary(*draft_vocab_for(None, run, target.vocab_size))
    if config.draft_lora is not None and not config.builds_with_lora:
        add_draft_lora(drafter, config.draft_lora)
    return drafter


def continued_drafter(config: DraftConfig, target: Target) -> Drafter:
    """The saved draft at ``config.init_from`` (checked as every loaded draft is: its files, its tokenizer, its
    weights), given the recipe's training settings."""
    section = resolved_section(config)
    # as saved, then in fp32 as a fresh draft is built: a draft in the target's half type would train without fp32
    # master weights (updates below bf16's resolution lost) and its LoRA adapters would be made in that type too
    drafter = load_drafter(config.init_from, target, as_saved=True)
    _params_to(drafter, torch.float32)
    drafter.config = section
    drafter.continued_from = drafter.loaded_from
    return drafter.train()


def resolved_section(config: DraftConfig) -> DraftConfig:
    """The draft section a run trains with: the recipe's, or under ``init_from`` the saved draft's with the recipe's
    training settings (read from its config alone: a recipe is checked before any model loads)."""
    if config.init_from is None:
        return config
    draft = SavedDraft.open(config.init_from)
    kind = draft.kind
    if kind.kind != config.kind:
        raise DrafttrainError(f"draft.init_from {config.init_from} holds a {kind.kind} draft; the recipe trains "
                              f"a {config.kind} draft")
    return continued_config(draft.section(), config, config.init_from)


def run_target_needs(config: DraftConfig, target: Target) -> TargetNeeds:
    """What a run of this draft section reads from ``target`` (the section resolved as the run trains it)."""
    section = resolved_section(config)
    return drafter_for(section).target_needs(section, target)


def check_vocabulary_choice(config: DraftConfig, new_vocabulary: bool) -> None:
    """A continued draft drafts over a vocabulary chosen on the new data only when its kind can adopt one."""
    if config.init_from is not None and new_vocabulary and not drafter_for(config).adopts_vocabulary:
        raise DrafttrainError(f"draft.init_from: a {config.kind} draft keeps the draft vocabulary it was trained "
                              "with; set draft_vocab.enabled: false")


def saved_draft_ids(path: str | Path | SavedDraft) -> torch.Tensor | None:
    """The target ids the saved draft at ``path`` drafts over (from its d2t), None when it has no draft vocabulary."""
    weights = SavedDraft.open(path).directory / WEIGHTS_NAME
    with safe_open(str(weights), "pt") as tensors:
        return draft_ids(tensors.get_tensor("d2t")) if "d2t" in tensors.keys() else None


def saved_draft_vocab_size(path: str | Path | SavedDraft) -> int | None:
    """How many tokens the saved draft at ``path`` drafts over (its d2t), None when it has no draft vocabulary."""
    ids = saved_draft_ids(path)
    return None if ids is None else ids.numel()


def continued_config(saved: DraftConfig, recipe: DraftConfig, where: str) -> DraftConfig:
    """The saved draft's section with the recipe's training settings (those it sets); any other setting the recipe
    gives must equal the saved draft's, since the weights were made with it."""
    cannot = saved.cannot_continue()
    if cannot:
        raise DrafttrainError(f"draft.init_from {where}: {cannot}")
    clashes, changes = _recipe_changes(saved, recipe, "draft.", skip={"kind", "init_from", "draft_lora"})
    if clashes:
        raise DrafttrainError(f"draft.init_from keeps the architecture of the draft at {where}, which the recipe "
                              "contradicts: " + "; ".join(f"{name} is {mine!r} in the recipe, {theirs!r} in the draft"
                                                          for name, mine, theirs in clashes)
                              + " (leave these out of the recipe)")
    merged = {**_merged(saved.model_dump(), changes), "init_from": recipe.init_from,
              "draft_lora": recipe.draft_lora.model_dump() if recipe.draft_lora else None}
    try:
        return type(saved).model_validate(merged)
    except ValidationError as err:
        raise DrafttrainError(f"draft.init_from {where}: the recipe's settings do not fit the saved draft: "
                              f"{err.errors()[0]['msg']}") from None


def _recipe_changes(saved: Section, recipe: Section, prefix: str, skip: frozenset[str] | set[str] = frozenset()
                    ) -> tuple[list[tuple[str, Any, Any]], dict[str, Any]]:
    """What the recipe sets against a saved section: (dotted name, recipe's, saved) for each setting of the weights'
    that differs, and the training settings it gives, sub-sections (``parallel``) compared setting by setting."""
    clashes, changes = [], {}
    for name in sorted(recipe.model_fields_set - skip):
        mine, theirs = getattr(recipe, name), getattr(saved, name)
        if name in recipe.training_settings:
            changes[name] = mine
        elif isinstance(mine, Section) and type(mine) is type(theirs):
            inner_clashes, inner = _recipe_changes(theirs, mine, f"{prefix}{name}.")
            clashes += inner_clashes
            if inner:
                changes[name] = _SubChanges(inner)
        elif mine != theirs:
            clashes.append((f"{prefix}{name}", mine, theirs))
    return clashes, changes


class _SubChanges(dict):
    """A sub-section's changes, merged into the saved sub-section rather than replacing it."""


def _merged(saved: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    return {**saved, **{name: _merged(saved[name], value) if isinstance(value, _SubChanges) else value
                        for name, value in changes.items()}}


def _from_export(cls: type[Drafter], directory: Path, config: dict, target: Target) -> tuple[Drafter, dict]:
    """A folder ``drafttrain export`` wrote: read back into the kind's own layout, then loaded as a checkpoint.
    Returns the draft and its config in the checkpoint's layout."""

    fmt, codecs = config["drafttrain"]["export"]["format"], codecs_of(cls)
    if fmt not in codecs:
        raise damaged(directory / CONFIG_NAME, f"says it is a {cls.kind} draft in format {fmt!r}, which the kind "
                                               f"does not write ({', '.join(codecs)})")
    if (directory / WEIGHTS_NAME).is_file() and fmt != "hf":
        tensors, _ = read_safetensors(directory / WEIGHTS_NAME)
        config, tensors = codecs[fmt].read(config, tensors)
        with tempfile.TemporaryDirectory(prefix="drafttrain-import-") as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, f"{tmp}/{WEIGHTS_NAME}")
            (Path(tmp) / CONFIG_NAME).write_text(json.dumps(config))
            return cls.from_pretrained(tmp, target), config
    return cls.from_pretrained(directory, target), config


def _check_engine_config(drafter: Drafter, config: dict, directory: Path) -> None:
    """What engines read from config.json must describe the draft we load (which is built from the ``drafttrain``
    section and the weights): a Medusa config saying 2 heads over weights of 3 would be served as 2 heads by vLLM
    and measured as 3 here. ``config``: the file's, in the checkpoint's layout (an export's read back by the kind's
    ``imported``). Compared: the top-level numbers, strings and flags of the config this draft writes."""
    for key, value in drafter.interchange_config().items():
        if key in config and isinstance(value, (bool, int, float, str)) and config[key] != value:
            if unrecorded_fact(drafter, key, config):  # a draft that records only its target's name and sizes
                raise DrafttrainError(
                    f"{directory / CONFIG_NAME} says {key} = {config[key]!r}, but built for target "
                    f"{drafter.target.name!r} the draft has {value!r}: it was trained for another target (it records "
                    f"{(config['drafttrain'].get('target') or {}).get('name')!r}), or the file was edited. Serve it "
                    "with the target it was trained for")
            raise damaged(directory / CONFIG_NAME, f"says {key} = {config[key]!r}, but the draft it holds has "
                                                   f"{value!r}: engines would serve another draft than this one")


def _params_to(drafter: Drafter, dtype: torch.dtype) -> None:
    """The draft's floating-point parameters in ``dtype``; its buffers stay as built: the rotary frequencies are
    kept in fp32 by HF's own models in any dtype, and in bf16 their phase error reaches 1.4 rad at 1k tokens."""
    for param in drafter.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)


def load_drafter(path: str | Path | SavedDraft, target: Target, *, as_saved: bool = False) -> Drafter:
    """Load a saved draft of any kind and attach ``target``. ``path`` may also be a run's output_dir or
    checkpoints folder: its best checkpoint is loaded. Its weights take the target's dtype, as the engines serve a
    draft (a head trained in fp32 beside a bf16 target failed at its first matmul on a GPU); ``as_saved`` keeps
    them as written, for the paths that rewrite or compare the weights (export, import).

    Checked on the way: the files against the checkpoint's manifest (checksums), the target it records against
    this one (tokenizer, architecture, sizes: check_target), its config against its weights, and the weights for
    NaN/inf."""
    directory = path.directory if isinstance(path, SavedDraft) else find_draft(path)
    checked: dict = {}  # the manifest's file entries, just verified: their sha256 need not be computed again
    if (directory / MANIFEST).is_file():
        verify_manifest(directory)
        checked = read_json(directory / MANIFEST)["files"]
    saved = path if isinstance(path, SavedDraft) else SavedDraft.open(directory)  # read after the manifest's check
    kind, config = saved.kind, saved.config
    try:
        cls = drafter_for(saved.section())
        check_target(config, target, directory, cls.target_facts)
        drafter, config = _from_export(cls, directory, config, target) if config["drafttrain"].get("export") \
            else (cls.from_pretrained(directory, target), config)
    except DrafttrainError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as err:  # a config edited or written by something else
        raise damaged(directory / CONFIG_NAME, f"does not describe a loadable {kind.kind} draft "
                                               f"({type(err).__name__}: {err})") from None
    except (OSError, SafetensorError) as err:  # files read by transformers or peft (draft models, adapters)
        raise damaged(directory, f"holds a {kind.kind} draft whose files cannot be read ({type(err).__name__}: "
                                 f"{str(err).splitlines()[0][:200] if str(err) else 'unreadable'})") from None
    if not as_saved:
        _params_to(drafter, target.model.dtype)
    drafter.check_finite(directory)  # after the cast: an fp16 target would turn a large weight into inf
    drafter.check_vocabulary(directory)
    _check_engine_config(drafter, config, directory)
    weights = directory / WEIGHTS_NAME
    sha = (checked.get(WEIGHTS_NAME) or {}).get("sha256") or (file_sha256(weights) if weights.is_file() else None)
    drafter.loaded_from = {"path": str(directory), "weights_sha256": sha}
    drafter.trained_for = (config["drafttrain"].get("target") or {}).get("name")
    return drafter


def recognised_foreign(config: dict) -> tuple[type[Drafter], ForeignReader] | None:
    """The kind of a draft folder another tool wrote and the reader of its format, when a reader recognises its
    config.json (None: no draft format drafttrain imports)."""
    return next(((kind, reader) for kind in KINDS.values() for reader in readers_of(kind) if reader.recognises(config)),
                None)


def foreign_draft(path: str | Path) -> tuple[type[Drafter], str] | None:
    """The kind and format of a draft another tool wrote at ``path``, which ``drafttrain import`` reads; None for
    anything else (a drafttrain draft, a whole model, no model folder). A folder whose config is a plain Llama's
    (as EAGLE-1's trainer writes a head's) is a whole model when its weights hold the model's layers ("model.*")."""
    folder = Path(path).expanduser()
    if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
        return None
    config = read_json(folder / CONFIG_NAME)
    found = recognised_foreign(config) if isinstance(config, dict) and "drafttrain" not in config else None
    if found is None:
        return None
    try:
        with safe_open(str(folder / WEIGHTS_NAME), "pt") as tensors:
            whole_model = any(name.startswith("model.") for name in tensors.keys())
    except (OSError, SafetensorError):
        return None  # unreadable weights: the path that loads it names the file
    return None if whole_model else (found[0], found[1].format_of(config))


def foreign_kind(config: dict, where: Path) -> tuple[type[Drafter], ForeignReader]:
    """The kind of a draft folder another tool wrote, and the reader of its format, from its config.json."""
    found = recognised_foreign(config)
    if found is None:
        known = {k: list(dict.fromkeys(f for r in readers_of(c) for f in r.formats)) for k, c in KINDS.items()}
        raise DrafttrainError(f"{where / CONFIG_NAME} is not a draft format drafttrain imports (known: "
                              + ", ".join(f"{k}: {', '.join(fmts)}" for k, fmts in known.items() if fmts) + ")")
    return found
