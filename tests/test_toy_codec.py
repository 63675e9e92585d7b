"""A serving format is a codec of its kind: a toy format for EAGLE-3 heads defined here, in the test file alone, is a
format the kind is then written in (by drafttrain export's library call, with its model card and manifest) and read
back from, weight for weight, with no edit anywhere else. A variant with its own formats (P-EAGLE) does not gain it.

The toy: the interchange layout with every tensor under a ``head.`` prefix and the format named in its config."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_dflash import randomised
from test_export import tiny_target

from drafttrain.config import Eagle3Config
from drafttrain.drafts import build_drafter, load_drafter
from drafttrain.drafts.codecs import Codec, Exported, add_codec, codecs_of, remove_codec, writable_formats
from drafttrain.drafts.eagle3 import Eagle3Drafter
from drafttrain.drafts.registry import known_formats
from drafttrain.export import export_draft

PREFIX = "head."


class PrefixedCodec(Codec):
    fmt = "toy_prefixed"

    def write(self, drafter) -> Exported:
        config = drafter.checkpoint_config(export={"format": self.fmt})
        return Exported({**config, "toy_layout": "prefixed"},
                        {PREFIX + name: t for name, t in drafter.state_tensors().items()},
                        notes=["every tensor under head."])

    def read(self, config, tensors):
        back = {k: v for k, v in config.items() if k != "toy_layout"}
        return back, {name.removeprefix(PREFIX): t for name, t in tensors.items()}


@pytest.fixture
def toy_format():
    add_codec(Eagle3Drafter, PrefixedCodec())
    yield PrefixedCodec.fmt
    remove_codec(Eagle3Drafter, PrefixedCodec.fmt)


def test_the_toy_format_is_written_and_read_back_weight_for_weight(toy_format, tmp_path):
    target = tiny_target()
    drafter = randomised(build_drafter(Eagle3Config(), target)).eval()
    assert toy_format in writable_formats(drafter) and toy_format in known_formats()
    checkpoint = drafter.save_pretrained(tmp_path / "checkpoint")
    export = export_draft(checkpoint, toy_format, tmp_path / "export", target)
    assert json.loads((export / "config.json").read_text())["toy_layout"] == "prefixed"
    assert all(name.startswith(PREFIX) for name in load_file(str(export / "model.safetensors")))
    assert "every tensor under head." in (export / "README.md").read_text()
    loaded = load_drafter(export, target)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_variant_with_formats_of_its_own_does_not_gain_the_kinds_new_one(toy_format):
    from drafttrain.drafts.peagle import PEagleDrafter

    assert toy_format in codecs_of(Eagle3Drafter) and toy_format not in codecs_of(PEagleDrafter)


def test_without_the_codec_the_format_is_unknown(tmp_path):
    assert PrefixedCodec.fmt not in known_formats()
    target = tiny_target()
    checkpoint = build_drafter(Eagle3Config(), target).save_pretrained(tmp_path / "checkpoint")
    with pytest.raises(Exception, match="unknown export format 'toy_prefixed'"):
        export_draft(checkpoint, PrefixedCodec.fmt, tmp_path / "export", target)
