"""Runs inside speculators' own venv (never imports drafttrain): loads a speculators-format export with speculators'
own classes and runs its first drafting step over given target hidden states, writing what it predicted.

    python speculators_worker.py JOB.json OUT.safetensors

JOB: {"draft": dir, "inputs": file.safetensors with hidden [1, T, k*H] (the target's tapped states) and
      input_ids [1, T] (token t+1 at position t, as speculators' data pipeline feeds them)}
OUT: logits [1, T, draft_vocab] of its lm_head, draft_tokens [1, T] (draft-vocabulary ids), and
     embed_zero (1 if its token embeddings loaded all zeros), embed_nan (1 if any is NaN).
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file

from speculators.models.eagle3.core import Eagle3DraftModel


def main(job_path: str, out_path: str) -> None:
    job = json.load(open(job_path))
    config = Eagle3DraftModel.config_class.from_pretrained(job["draft"])
    # as speculators' trainer does for --draft-attn-impl sdpa (flex attention, its default, has no CPU backward)
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = Eagle3DraftModel.from_pretrained(job["draft"], config=config).float().eval()
    model.load_verifier_weights()  # what speculators does before training or serving: fills only NaN tensors
    inputs = load_file(job["inputs"])
    captured = {}
    model.lm_head.register_forward_hook(lambda module, args, out: captured.__setitem__("logits", out))
    ids = inputs["input_ids"]
    with torch.no_grad():
        tokens = model(hidden_states=inputs["hidden"], input_ids=ids, document_ids=torch.zeros_like(ids),
                       ttt_steps=1)
    embed = model.embed_tokens.weight
    save_file({"logits": captured["logits"].float().contiguous(), "draft_tokens": tokens[0].contiguous(),
               "embed_zero": torch.tensor([int(bool((embed == 0).all()))]),
               "embed_nan": torch.tensor([int(bool(embed.isnan().any()))])}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
