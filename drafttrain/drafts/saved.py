"""Saved drafts: a checkpoint, a run's best, an export or an import, found and read once (``SavedDraft``), and loaded
as its kind's draft with every check on the way (``load_drafter``)."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from drafttrain import DrafttrainError
from drafttrain.config import DraftConfig
from drafttrain.data.vocab import draft_ids
from drafttrain.drafts.base import Drafter, check_target, read_draft_config_file, saved_section, unrecorded_fact
from drafttrain.drafts.codecs import codecs_of
from drafttrain.drafts.registry import KINDS, drafter_for
from drafttrain.runfolder import (
    CONFIG_NAME,
    MANIFEST,
    WEIGHTS_NAME,
    FileDigest,
    damaged,
    drafttrain_checkpoint,
    file_sha256,
    find_draft,
    read_json,
    read_safetensors,
    verify_manifest,
)
from drafttrain.targets import Target


@dataclasses.dataclass(frozen=True)
class SavedDraft:
    """A saved draft (a checkpoint, a run's best, an export, an import), found and read once: its folder, its
    config.json and its kind's class. Pass it on instead of its path, so nothing finds and reads it again."""

    directory: Path
    config: dict
    kind: type[Drafter]
    config_digest: FileDigest | None = None  # of the bytes config was read from: a manifest's check reads it no more

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
        config, digest = read_draft_config_file(directory)
        kind = config["drafttrain"]["kind"]
        if kind not in KINDS:
            raise damaged(directory / CONFIG_NAME, f"names draft kind {kind!r}, which is not one of {', '.join(KINDS)}")
        return cls(directory, config, KINDS[kind], digest)

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
        read = {CONFIG_NAME: path.config_digest} if isinstance(path, SavedDraft) and path.config_digest else {}
        verify_manifest(directory, known=read)
        checked = read_json(directory / MANIFEST)["files"]
    saved = path if isinstance(path, SavedDraft) else SavedDraft.open(directory)  # read after the manifest's check
    kind, config = saved.kind, saved.config
    try:
        cls = drafter_for(saved.section())
        check_target(config, target, directory, cls.target_facts)
        drafter, config = _from_export(cls, directory, config, target) if config["drafttrain"].get("export") \
            else (cls.from_pretrained(directory, target, config), config)
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


def saved_draft_ids(path: str | Path | SavedDraft) -> torch.Tensor | None:
    """The target ids the saved draft at ``path`` drafts over (from its d2t), None when it has no draft vocabulary."""
    weights = SavedDraft.open(path).directory / WEIGHTS_NAME
    with safe_open(str(weights), "pt") as tensors:
        return draft_ids(tensors.get_tensor("d2t")) if "d2t" in tensors.keys() else None


def saved_draft_vocab_size(path: str | Path | SavedDraft) -> int | None:
    """How many tokens the saved draft at ``path`` drafts over (its d2t), None when it has no draft vocabulary."""
    ids = saved_draft_ids(path)
    return None if ids is None else ids.numel()
