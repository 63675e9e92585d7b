"""The catalogue of draft kinds: each kind one registry entry, its class saying everything about it
(drafttrain.drafts.base.Drafter), its variants, and the built-in kinds' list. Saved drafts are drafts/saved.py, a
run's resolved draft section drafts/continuation.py, other tools' drafts drafts/foreign.py."""

from __future__ import annotations

import dataclasses

from drafttrain import DrafttrainError
from drafttrain.config import DraftConfig, register_draft_section, unregister_draft_section
from drafttrain.drafts.base import Drafter
from drafttrain.drafts.codecs import Codec, ForeignReader, codecs_of, register_codecs, unregister_codecs
from drafttrain.drafts.dflash import DFlashDrafter
from drafttrain.drafts.draft_model import DraftModelDrafter
from drafttrain.drafts.eagle import EagleDrafter
from drafttrain.drafts.eagle3 import Eagle3Drafter
from drafttrain.drafts.formats import dflash as dflash_formats
from drafttrain.drafts.formats import draft_model as draft_model_formats
from drafttrain.drafts.formats import eagle as eagle_formats
from drafttrain.drafts.formats import eagle3 as eagle3_formats
from drafttrain.drafts.formats import medusa as medusa_formats
from drafttrain.drafts.formats import mtp as mtp_formats
from drafttrain.drafts.medusa import MedusaDrafter
from drafttrain.drafts.mtp import MtpDrafter
from drafttrain.drafts.pard import PardDrafter
from drafttrain.drafts.peagle import PEagleDrafter
from drafttrain.runfolder import (
    RunFolder,
)
from drafttrain.targets import Target

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
    BuiltinKind(MtpDrafter, (), ((MtpDrafter, mtp_formats.MTP_CODECS, mtp_formats.MTP_READERS),)),
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


def build_drafter(config: DraftConfig, target: Target, run: RunFolder | None = None) -> Drafter:
    """A fresh draft of the recipe's kind (or the variant its section selects) for ``target`` (``run``: the run
    folder prepare wrote)."""
    cls = drafter_class(config.kind)
    if not isinstance(config, cls.config_class):
        raise DrafttrainError(f"a {config.kind} draft is built from a {cls.config_class.__name__} section, not a "
                              f"{type(config).__name__}")
    return drafter_for(config).build(config, target, run)


