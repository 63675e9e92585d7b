"""Serving formats as codecs: one per (kind, format), kept beside the kind (drafttrain/drafts/formats/), as speculators
keeps ``convert/<kind>/``.

A ``Codec`` writes a draft in its format (``write``: the config, tensors, sub-folders and card notes of an export),
reads such an export back into the kind's checkpoint layout (``read``), says why a draft, as configured, is not
written in it (``refusal``: an option the format's readers do not apply), and owns how engines serve its files
(``serving``: for each engine that reads the format, its method and options; drafttrain.engines turns that into a
server's flags and the model card's command). A ``ForeignReader`` recognises a draft another tool wrote
(``recognises``) and reads it as the kind's (``read_foreign``).

A kind's codecs are one table registered for its class (``register_codecs``); a variant registers its own table
(P-EAGLE: speculators' format alone), else it uses its kind's. The exporter, the loader, the importer, the card and
the bench reach every format through here, never through a kind's name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from drafttrain.config import DraftConfig
from drafttrain.engines.server import Serving
from drafttrain.targets import Target
from drafttrain.targets.loading import verifier_path

# drafttrain.drafts.base.Drafter, which builds on this module (its export_formats asks the codecs)
Drafter = Any

Tensors = dict[str, torch.Tensor]
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format the exports write (and are tested with)


def speculators_config(algorithm: str, tokens: int, target: Target) -> dict[str, Any]:
    """speculators' ``speculators_config``: the algorithm, greedy proposals of ``tokens`` tokens, and the verifier
    (the target, by the path or Hub id it is served from, and its architectures)."""
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier_path(target),
                         "architectures": list(getattr(target.config, "architectures", None) or [])}}


@dataclasses.dataclass
class Exported:
    """A draft in one engine's format: ``config`` (config.json) and ``tensors`` (model.safetensors); ``folders``:
    writers of whole model folders, by sub-folder name ("" = the export itself, for a draft that is a whole HF
    model; its config.json gains ``config``), e.g. Medusa-2's adapted target, merged; ``notes``: what the engine
    does differently, for the model card; ``files``: the card's lines for what the export holds beyond config,
    weights, manifest and report (those folders)."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    folders: dict[str, Callable[[Path], None]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    files: list[str] = dataclasses.field(default_factory=list)


class Codec:
    """One serving format of a kind."""

    fmt: ClassVar[str]
    # each engine that serves drafts written in this format, with its speculative method for them
    engines: ClassVar[dict[str, str]] = {}
    names_verifier: ClassVar[bool] = False  # the export names the target it serves beside (speculators' config)

    def refusal(self, drafter: Drafter) -> str | None:
        """Why this draft, as configured, is not written in this format (None: it is; "": it is not, for no reason
        of its own beyond the formats it is written in)."""
        return None

    def write(self, drafter: Drafter) -> Exported:
        """The draft in this format. Its config keeps a ``drafttrain`` section (engines ignore it) that names the
        format, so ``read`` can take it back."""
        raise NotImplementedError

    def read(self, config: dict[str, Any], tensors: Tensors) -> tuple[dict[str, Any], Tensors]:
        """An export in this format back to the kind's checkpoint (config, tensors): the inverse of ``write``."""
        raise NotImplementedError

    def serving(self, drafter: Drafter) -> dict[str, Serving]:
        """How each engine that reads this format is told to serve the draft (engine name -> Serving)."""
        return {engine: Serving(method, self.engine_options(drafter, engine), self.names_verifier)
                for engine, method in self.engines.items()}

    def engine_options(self, drafter: Drafter, engine: str) -> dict[str, Any]:
        """What ``engine``'s speculative config needs beside the method, the model and the token count."""
        return {}


class ForeignReader:
    """A format in which another tool writes drafts of a kind, read by ``drafttrain import``."""

    fmt: ClassVar[str]

    @property
    def formats(self) -> tuple[str, ...]:
        """The formats it reads, as errors list them."""
        return (self.fmt,)

    def recognises(self, config: dict[str, Any]) -> bool:
        raise NotImplementedError

    def format_of(self, config: dict[str, Any]) -> str:
        """The format of a config it recognises."""
        return self.fmt

    def folder_tensors(self, source: Path, config: dict[str, Any], target: Target) -> tuple[Tensors, Path] | None:
        """The draft's tensors when they sit among a whole model's weights (a model folder that ships its own draft,
        sharded or not), and the file that identifies them; None (here): the folder's model.safetensors is the draft."""
        return None

    def read_foreign(self, config: dict[str, Any], tensors: Tensors, target: Target) \
            -> tuple[DraftConfig, dict[str, Any], Tensors, list[str]]:
        """The foreign draft as the kind's (draft section, checkpoint config without the ``drafttrain`` section,
        tensors, notes on what drafttrain serves differently), checked against ``target``: the first thing that
        disagrees with the target is an error naming it."""
        raise NotImplementedError


CODECS: dict[type[Drafter], dict[str, Codec]] = {}  # a class -> its formats, in the order it prefers them
FOREIGN: dict[type[Drafter], list[ForeignReader]] = {}


def register_codecs(cls: type[Drafter], codecs: list[Codec], foreign: list[ForeignReader] = ()) -> None:
    """The formats drafts of class ``cls`` (a kind's, or a variant's) are written in, first the one it prefers, and
    the formats of other tools it reads."""
    CODECS[cls] = {codec.fmt: codec for codec in codecs}
    FOREIGN[cls] = list(foreign)


def add_codec(cls: type[Drafter], codec: Codec) -> None:
    """One more format for ``cls`` (and its variants that use its table)."""
    CODECS.setdefault(cls, dict(codecs_of(cls)))[codec.fmt] = codec


def remove_codec(cls: type[Drafter], fmt: str) -> None:
    CODECS.get(cls, {}).pop(fmt, None)


def unregister_codecs(cls: type[Drafter]) -> None:
    """Take ``cls``'s table out again (a kind that lives for a while only, as a test's toy)."""
    CODECS.pop(cls, None)
    FOREIGN.pop(cls, None)


def _table_class(cls: type[Drafter]) -> type[Drafter] | None:
    return next((c for c in cls.__mro__ if c in CODECS), None)


def codecs_of(cls: type[Drafter]) -> dict[str, Codec]:
    """The formats of a draft class: its table, else its nearest base's (none: it is not exported)."""
    owner = _table_class(cls)
    return CODECS[owner] if owner is not None else {}


def readers_of(cls: type[Drafter]) -> list[ForeignReader]:
    owner = _table_class(cls)
    return FOREIGN[owner] if owner is not None else []


def refused(drafter: Drafter, fmt: str) -> str | None:
    """Why ``drafter`` is not written in ``fmt``, as an error says it; None: it is."""
    codec = codecs_of(type(drafter)).get(fmt)
    why = codec.refusal(drafter) if codec is not None else ""
    if why is None:
        return None
    formats = writable_formats(drafter)
    if why:  # an option or a variant of this draft narrows its kind's formats: that says why
        return f"{why}, not {fmt!r}: export --format {' or '.join(formats)}"
    return f"a {drafter.kind} draft exports to {', '.join(formats)}, not {fmt} (--format {' or '.join(formats)})"


def writable_formats(drafter: Drafter) -> tuple[str, ...]:
    """The formats this draft, as configured, is written in, the one it prefers first."""
    return tuple(fmt for fmt, codec in codecs_of(type(drafter)).items() if codec.refusal(drafter) is None)
