"""Runs inside speculators' own venv (never imports drafttrain): loads a speculators-format export with speculators'
own classes and runs its drafting forward over given target hidden states, writing what it predicted.

    python speculators_worker.py JOB.json OUT.safetensors

JOB: {"kind": "eagle3" | "dflash" | "peagle", "draft": dir, "inputs": file.safetensors with hidden [1, T, k*H] (the target's
      tapped states) and input_ids [1, T] (eagle3: token t+1 at position t, as speculators' data pipeline feeds
      them; dflash: the tokens themselves), for dflash anchors [A] (the block anchors to draft from), for peagle
      slots [2, T + S] (the anchor and depth of every real pair and mask slot, as its COD sampler returns them)}
OUT: logits of its lm_head (eagle3 [1, T, V']; dflash [1, A*W, V']), draft_tokens (their argmax, draft ids), and
     embed_zero (1 if its token embeddings loaded all zeros), embed_nan (1 if any is NaN).
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.models.dflash import core as dflash_core
from speculators.models.dflash.core import DFlashDraftModel
from speculators.models.eagle3.core import Eagle3DraftModel
from speculators.models.peagle import core as peagle_core
from speculators.models.peagle.core import PEagleDraftModel

CLASSES = {"eagle3": Eagle3DraftModel, "dflash": DFlashDraftModel, "peagle": PEagleDraftModel}


def load(kind: str, folder: str):
    cls = CLASSES[kind]
    config = cls.config_class.from_pretrained(folder)
    # as speculators' trainer does for --draft-attn-impl sdpa (flex attention, its default, has no CPU backward)
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = cls.from_pretrained(folder, config=config).float().eval()
    model.load_verifier_weights()  # what speculators does before training or serving: fills only NaN tensors
    return model


def run_eagle3(model, inputs):
    ids = inputs["input_ids"]
    tokens = model(hidden_states=inputs["hidden"], input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=1)
    return tokens[0]


def run_dflash(model, inputs):
    anchors = inputs["anchors"]
    # the blocks at our anchors instead of its random ones
    dflash_core.select_anchors = lambda *args, **kwargs: (anchors, torch.ones_like(anchors, dtype=torch.bool))
    ids = inputs["input_ids"]
    hidden = inputs["hidden"]
    _, logits, _, _, _ = model._backbone_forward(
        hidden, ids, torch.ones_like(ids), torch.zeros(1, ids.shape[1], model.hidden_size), torch.zeros_like(ids),
        max_anchors=anchors.numel())
    return logits.argmax(-1)


def run_peagle(model, inputs):
    ids, slots = inputs["input_ids"], inputs["slots"]  # slots: (anchor, depth) of every real pair and mask slot
    # our slots instead of its random COD sample
    peagle_core.generate_cod_sample_indices = lambda **kwargs: (slots[0], slots[1])
    peagle_core.compute_metrics = lambda **kwargs: (torch.zeros(()), {})  # its loss (a Triton kernel) is not needed
    model(hidden_states=inputs["hidden"], input_ids=ids, document_ids=torch.zeros_like(ids),
          verifier_last_hidden_states=torch.zeros(1, ids.shape[1], model.hidden_size))
    return None


def main(job_path: str, out_path: str) -> None:
    job = json.load(open(job_path))
    model = load(job["kind"], job["draft"])
    inputs = load_file(job["inputs"])
    captured = {}
    model.lm_head.register_forward_hook(lambda module, args, out: captured.__setitem__("logits", out))
    with torch.no_grad():
        tokens = {"eagle3": run_eagle3, "dflash": run_dflash, "peagle": run_peagle}[job["kind"]](model, inputs)
    if tokens is None:
        tokens = captured["logits"].argmax(-1)
    embed = model.embed_tokens.weight
    save_file({"logits": captured["logits"].float().contiguous(), "draft_tokens": tokens.contiguous(),
               "embed_zero": torch.tensor([int(bool((embed == 0).all()))]),
               "embed_nan": torch.tensor([int(bool(embed.isnan().any()))])}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
