"""The MTP layer's serving formats, both under the target's own checkpoint keys (drafttrain.targets.mtp):

* ``vllm``: a draft folder vLLM loads as the speculative model (``method: mtp``, ``model: <folder>``): the
  target's config counting one MTP layer, and the layer's weights alone (vLLM shares the target's embeddings and
  lm_head with an MTP draft);
* ``hf``: the target's checkpoint with the layer stitched in (its safetensors copied, the layer's written beside
  them, the index and config counting it), a model folder that serves with its MTP draft by itself
  (``vllm serve FOLDER --speculative-config '{"method": "mtp", ...}'``) and loads in transformers' MtpModel.

A published model's own MTP layer imports the same way (``drafttrain import MODEL_FOLDER``): ``NativeMtp``
recognises a model config counting MTP layers and reads the layer by its keys.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from drafttrain import DrafttrainError
from drafttrain.config.kinds.mtp import MtpConfig
from drafttrain.drafts.codecs import Codec, Exported, ForeignReader
from drafttrain.drafts.layers import check_target_sizes
from drafttrain.drafts.mtp import MtpDrafter
from drafttrain.runfolder import CONFIG_NAME, WEIGHTS_NAME
from drafttrain.targets import Target
from drafttrain.targets.mtp import FAMILIES, INDEX_NAME, checkpoint_keys, mtp_family, native_tensors_in, read_tensors

STITCHED_FILE = "model-mtp.safetensors"  # the layer's own file in a stitched checkpoint
TARGET_FILE = "model-target.safetensors"  # a one-file target's weights in a stitched checkpoint
METHOD = "mtp"  # vLLM's speculative method for a family's MTP layer (it picks the family's MTP model itself)


def weights_dtype(drafter: MtpDrafter) -> str:
    return str(drafter.feature_dtype).removeprefix("torch.")


class Vllm(Codec):
    fmt = "vllm"
    engines = {"vllm": METHOD}

    def write(self, drafter: MtpDrafter) -> Exported:
        config = {**drafter.checkpoint_config(export={"format": self.fmt}), "dtype": weights_dtype(drafter)}
        return Exported(config, drafter.state_tensors(),
                        notes=["the MTP layer alone, under the target's checkpoint keys; vLLM takes the target's "
                               "embeddings and lm_head"])

    def read(self, config, tensors):
        return config, tensors


class Stitched(Codec):
    fmt = "hf"
    engines = {"vllm": METHOD}

    def write(self, drafter: MtpDrafter) -> Exported:
        source = drafter.target.source_dir
        if source is None:
            raise DrafttrainError(f"the target {drafter.target.name!r} was not loaded from a folder: a stitched "
                                  "checkpoint copies the target's files (export --format vllm writes the layer alone)")
        config = {drafter.family.count_field: 1,
                  "drafttrain": drafter.checkpoint_config(export={"format": self.fmt})["drafttrain"]}
        return Exported(config, folders={"": lambda folder: stitch(drafter, source, folder)},
                        notes=["the target's checkpoint with its MTP layer replaced by this one: serve the folder itself"],
                        files=[f"- `{STITCHED_FILE}`: the MTP layer; the other safetensors are the target's"])

    def read(self, config, tensors):
        return config, tensors


def stitch(drafter: MtpDrafter, source: Path, folder: Path) -> None:
    """A copy of the target's model folder (``source``) in ``folder`` whose MTP layer is the draft's: the target's
    own tensors copied, any MTP layer it shipped left out, the draft's in ``STITCHED_FILE``, the index naming it."""
    folder.mkdir(parents=True, exist_ok=True)
    layer = drafter.state_tensors()
    keys = checkpoint_keys(source)
    shipped = set(native_tensors_in(source, drafter.target) or {})
    weight_map = {}
    for file in sorted(set(keys.values())):
        names = [name for name, where in keys.items() if where == file]
        # a one-file target is copied under another name: loaders read a folder's model.safetensors alone when present
        copy = folder / (TARGET_FILE if file.name == WEIGHTS_NAME else file.name)
        if any(name in shipped for name in names):  # a file holding the layer it shipped: written without it
            save_file(read_tensors({name: file for name in names if name not in shipped}), str(copy),
                      metadata={"format": "pt"})
        else:
            shutil.copyfile(file, copy)
        weight_map.update({name: copy.name for name in names if name not in shipped})
    save_file(layer, str(folder / STITCHED_FILE), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(layer, STITCHED_FILE))
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))},
                                                indent=2))
    for other in source.iterdir():  # tokenizer, generation config, chat template: what serving the folder reads
        if other.is_file() and other.suffix != ".safetensors" and other.name not in (INDEX_NAME, CONFIG_NAME):
            shutil.copyfile(other, folder / other.name)
    (folder / CONFIG_NAME).write_text((source / CONFIG_NAME).read_text())


class NativeMtp(ForeignReader):
    """A model folder whose checkpoint ships its family's MTP layer (a published DeepSeek-V3, GLM-4.5, Qwen3-Next or
    Qwen3.5, sharded or not): the layer, read by its keys, as a checkpoint to evaluate, export or continue."""

    fmt = "native"

    def recognises(self, config) -> bool:
        family = FAMILIES.get(config.get("model_type"))
        # the Qwens' configs need not count the layer they ship; a DeepSeek-layout config counts it
        return family is not None and (family.beside or bool(config.get(family.count_field)))

    def folder_tensors(self, source: Path, config, target: Target):
        if config.get("num_hidden_layers") != target.num_layers or config["model_type"] != target.config.model_type:
            raise DrafttrainError(f"{source} is a {config['model_type']} model of {config.get('num_hidden_layers')} "
                                  f"layers, the target {target.name!r} a {target.config.model_type} of "
                                  f"{target.num_layers}: import a model's MTP layer for that model")
        native = native_tensors_in(source, target)
        if native is None:
            raise DrafttrainError(f"{source} is a {config['model_type']} model folder whose checkpoint ships no MTP "
                                  "layer: nothing to import")
        index = source / INDEX_NAME
        return native, index if index.is_file() else next(iter(sorted(set(checkpoint_keys(source).values()))))

    def read_foreign(self, config, tensors, target: Target):
        check_target_sizes(config, target, "the model's")
        return MtpConfig(), {k: v for k, v in config.items() if k != "quantization_config"}, tensors, \
            ["the checkpoint's copies of the embedding and lm_head are left out: the layer reads the target's own"] \
            if not mtp_family(target).beside else []


MTP_CODECS = [Vllm(), Stitched()]
MTP_READERS = [NativeMtp()]
