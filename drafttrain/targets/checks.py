"""Every way a target can fail to load, found before it loads and said in one line naming the file.

One check (``check_source``) runs wherever a model's config or weights are read (``load_target``, ``plan``,
``prepare``): a model folder's config.json (valid JSON, a model type transformers knows or code the recipe lets
run, settings that agree with each other, a decoder-only causal LM: not an encoder-decoder nor a multimodal
model), its safetensors files (present, each header whole and the file as long as the header says) and, before a
GGUF file is converted, its header and length. A Hub id is left to the Hub's own answers.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import transformers
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from drafttrain import DrafttrainError
from drafttrain.userfiles import cause

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
REMOTE_CODE_MODULES = "transformers_modules"  # where transformers imports a model's own code
SUPPORTED = "drafttrain drafts for decoder-only causal LMs (Llama, Qwen, Mistral, Gemma, Phi, DeepSeek-V3, ...)"


def check_source(who: str, where: str | Path, trust_remote_code: bool = False, weights_required: bool = True) -> None:
    """Refuse, in one line naming the file, a local model that cannot load. ``who``: the model as the error names
    it ("target 'models/x'"); ``where``: the folder its spec resolved to, or a config.json given for it (a GGUF
    file is checked before its conversion, by ``check_gguf``; a Hub id is left to the Hub's answers). ``weights_required``: False where only
    the config is read (a plan): weights present are still checked, their absence is not."""
    path = Path(where)
    if not path.exists():
        return  # a Hub id
    check_causal_lm(who, read_config(who, path, trust_remote_code))
    if path.is_dir():
        check_weights(who, path, weights_required)


def read_config(who: str, source: str | Path, trust_remote_code: bool = False, **options):
    """The HF config of the model folder (or config.json file) ``source``; a config that cannot be read, that needs
    remote code the recipe does not allow, or whose settings contradict each other is refused."""
    source = Path(source)
    path = source / CONFIG if source.is_dir() else source
    _check_model_type(who, _config_json(who, path), trust_remote_code)
    try:
        return AutoConfig.from_pretrained(str(source), trust_remote_code=trust_remote_code, **options)
    except OSError as err:  # a file the config names is missing here (its own code, say)
        local = _first_line(err).split(" Checkout ")[0]  # transformers' pointer to the Hub, for a local folder
        raise DrafttrainError(f"{who}: {path} cannot be read by transformers ({local})") from None
    except Exception as err:  # noqa: BLE001 - transformers' validators raise their own types (StrictDataclass...)
        raise DrafttrainError(f"{who}: {path} contradicts itself or is not a config transformers reads "
                              f"({_last_line(err)}): correct it, or copy the model's config.json again") from None


def _config_json(who: str, path: Path) -> dict:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise DrafttrainError(f"{who}: {path} cannot be read ({cause(err)})") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise DrafttrainError(f"{who}: {path} is not valid JSON ({_last_line(err)}): copy the model's files "
                              "again") from None
    if not isinstance(raw, dict):
        raise DrafttrainError(f"{who}: {path} holds no config (a JSON object is expected)")
    return raw


def _check_model_type(who: str, raw: dict, trusted: bool) -> None:
    """A model type transformers knows, or the model's own code where the recipe lets it run."""
    model_type = raw.get("model_type")
    if model_type in CONFIG_MAPPING:
        return  # transformers' own class, whatever auto_map offers (remote code stays off)
    if not raw.get("auto_map"):
        named = f"names model_type {model_type!r}" if model_type else "names no model_type"
        raise DrafttrainError(f"{who}: its config.json {named}, which transformers {transformers.__version__} does "
                              "not know: upgrade transformers (pip install -U transformers) if the model is newer")
    if trusted:
        return
    code = ", ".join(sorted(set(map(str, raw["auto_map"].values()))))
    raise DrafttrainError(f"{who} needs its own modelling code ({code}): its model_type {model_type!r} is "
                          "not one transformers knows. drafttrain runs a model's code only when the recipe says "
                          "target.trust_remote_code: true (read that code first)")


def check_causal_lm(who: str, config) -> None:
    """A decoder-only causal LM: an encoder-decoder or a multimodal model is refused, saying what is supported."""
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or type(config).__module__.startswith(REMOTE_CODE_MODULES):
        return  # a model's own code (trust_remote_code) maps its classes itself
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise DrafttrainError(f"{who} is an encoder-decoder model ({model_type}): {SUPPORTED}; give a "
                              "decoder-only model")
    towers = [key for key in (getattr(config, "sub_configs", None) or {}) if key != "text_config"]
    if towers:
        text = getattr(getattr(config, "text_config", None), "model_type", None)
        tower = f" (its text tower is a {text})" if text else ""
        raise DrafttrainError(f"{who} is a multimodal model ({model_type}, with {', '.join(towers)}): "
                              f"{SUPPORTED}; a multimodal model's text tower is not supported as a target yet"
                              f"{tower}: give a text-only decoder model, e.g. the language model it was built from")
    raise DrafttrainError(f"{who} ({model_type}) is not a causal language model transformers loads with "
                          f"AutoModelForCausalLM: {SUPPORTED}")


def check_weights(who: str, folder: Path, required: bool = True) -> None:
    """Its safetensors files (model.safetensors, or the shards its index names) present and each whole."""
    for path in _weight_files(who, folder, required):
        try:
            problem = safetensors_problem(path)
        except OSError as err:
            problem = f"cannot be read ({cause(err)})"
        if problem is not None:
            raise DrafttrainError(f"{who}: its weights file {path} {problem}: copy the model's files again")


def _weight_files(who: str, folder: Path, required: bool) -> list[Path]:
    if (folder / WEIGHTS_INDEX).is_file():
        index = _config_json(who, folder / WEIGHTS_INDEX).get("weight_map")
        if not isinstance(index, dict):
            raise DrafttrainError(f"{who}: {folder / WEIGHTS_INDEX} has no weight_map: copy the model's "
                                  "files again")
        shards = [folder / shard for shard in sorted(set(map(str, index.values())))]
        missing = [shard.name for shard in shards if not shard.is_file()]
        if missing:
            raise DrafttrainError(f"{who}: {folder} lacks {len(missing)} of the {len(shards)} weight files "
                                  f"its {WEIGHTS_INDEX} names ({', '.join(missing[:3])}): copy them too")
        return shards
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    pickled = [f for f in PICKLED_WEIGHTS if (folder / f).is_file()]
    if pickled:
        raise DrafttrainError(f"{who}: {folder} holds its weights as {pickled[0]}, a pickle (it can run "
                              f"code), which drafttrain does not load: give the model with {WEIGHTS}")
    if required:
        raise DrafttrainError(f"{who}: {folder} holds no weights ({WEIGHTS}, or {WEIGHTS_INDEX} and the "
                              "files it names): copy them into the folder")
    return []


MAX_HEADER = 100 << 20  # the largest header the safetensors format allows


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file, from its header and length alone (None: nothing found)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        length = struct.unpack("<Q", f.read(8))[0] if size >= 8 else None
        if length is None or length > MAX_HEADER:
            return f"is damaged: it does not start with a safetensors header ({size:,} bytes)"
        if 8 + length > size:
            return f"is truncated: {size:,} bytes, fewer than its header alone ({8 + length:,})"
        header = f.read(length)
    try:
        tensors = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
        end = max((int(info["data_offsets"][1]) for info in tensors.values()), default=0)
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return "is damaged: its header is not a safetensors header"
    expected = 8 + length + end
    if expected > size:
        return f"is truncated: {size:,} bytes of the {expected:,} its header describes"
    if expected < size:
        return f"is damaged: {size - expected:,} bytes past the tensors its header describes"
    return None


def check_gguf(path: Path) -> None:
    """A GGUF file whose header reads whole and whose length holds every tensor the header describes."""
    try:
        problem = gguf_problem(path)
    except OSError as err:
        problem = f"cannot be read ({cause(err)})"
    if problem is not None:
        raise DrafttrainError(f"GGUF file {path} {problem}: copy or download it again")


# GGUF metadata value types -> bytes of one value (8: a string, 9: an array, read as such)
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4


class _EndOfFile(Exception):
    pass


class _Reader:
    """Little-endian reads from a buffer, raising _EndOfFile past its end."""

    def __init__(self, data) -> None:
        self.data, self.at = data, 0

    def take(self, count: int):
        if count < 0 or self.at + count > len(self.data):
            raise _EndOfFile
        self.at += count
        return self.data[self.at - count : self.at]

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> bytes:
        return bytes(self.take(self.u64()))

    def value(self, kind: int) -> object:
        if kind in _GGUF_SCALARS:
            raw = self.take(_GGUF_SCALARS[kind])
            return struct.unpack("<I", raw)[0] if kind == _GGUF_UINT32 else None
        if kind == _GGUF_STRING:
            return self.string()
        if kind != _GGUF_ARRAY:
            raise ValueError(f"an unknown metadata type {kind}")
        inner, count = self.u32(), self.u64()
        if inner in _GGUF_SCALARS:
            self.take(_GGUF_SCALARS[inner] * count)
        else:
            for _ in range(count):
                self.value(inner)
        return None


def gguf_problem(path: Path) -> str | None:
    """What is wrong with a GGUF file, from its header and length (None: nothing found)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            return f"is not a GGUF file (it does not start with GGUF; {size:,} bytes)"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                expected = _gguf_extent(_Reader(memoryview(data)[4:]))
            except _EndOfFile:
                return f"is truncated: it ends inside its header ({size:,} bytes)"
            except ValueError as err:
                return f"is damaged: its header holds {err}"
    if expected + 4 > size:
        return f"is truncated: {size:,} bytes of the {expected + 4:,} its header describes"
    return None


def _gguf_extent(reader: _Reader) -> int:
    """The bytes a GGUF file's header describes, after its 4-byte magic."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # only where a GGUF is read: 65 ms to import

    reader.u32()  # version
    tensors, entries = reader.u64(), reader.u64()
    alignment = 32
    for _ in range(entries):
        key = reader.string()
        kind = reader.u32()
        value = reader.value(kind)
        if key == b"general.alignment" and isinstance(value, int) and value > 0:
            alignment = value
    end = 0
    for _ in range(tensors):
        reader.string()
        dims = [reader.u64() for _ in range(reader.u32())]
        quant, offset = reader.u32(), reader.u64()
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(quant)]
        except (ValueError, KeyError):
            raise ValueError(f"a tensor of unknown type {quant}") from None
        count = 1
        for dim in dims:
            count *= dim
        end = max(end, offset + count // block * block_bytes)
    start = 4 + reader.at
    data_start = start + (-start) % alignment
    return data_start - 4 + end


def is_local(spec: str) -> bool:
    """A spec that names this machine's files, not a Hub id: a path that exists, one written as a path, or
    OWNER/NAME whose OWNER is a folder here (runs/missing is a path)."""
    path = Path(spec).expanduser()
    owner_here = path.parent.name != "" and path.parent.is_dir()
    return path.exists() or spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or owner_here


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


def _last_line(err: BaseException) -> str:
    """The line of a library's message that says what is wrong (validators wrap it in a header line)."""
    return (str(err).strip().splitlines() or [type(err).__name__])[-1].strip()[:300]
