"""What the tests run with speculators 0.9.0's own code, in its venv (tests/speculators_venv.py). It never imports
drafttrain: it is the other trainer.

  read DATA OUT MAX_LEN H LAYERS
      speculators' training dataset over DATA as `speculators train --data-path DATA --on-missing raise` reads it
      (speculators.train.data.ArrowDataset, then its CollateFn over every row): each row's tensors saved to OUT.
  capture MODEL ROWS DATA LAYER_IDS [FP8_ROW]
      a capture as speculators makes one: its `prepare-data` over ROWS (a jsonl of input_ids and loss_mask: rows
      that pass through, shuffled with seed 0) into DATA, then DATA/hidden_states/hs_{i}.safetensors for row i of
      that dataset, named and checked as `generate-offline-data` names and checks them
      (speculators.data_generation.offline.check_hidden_states). The states are what vLLM's extract_hidden_states
      gives for LAYER_IDS, from the transformers forward (vLLM is not run here): id k is hidden_states[k], the
      last id the input of the final norm (the state before it). Row FP8_ROW's file is written as hs_connectors'
      FP8HiddenStatesConnector writes its files (hs_connectors.fp8_utils.quantize_tensor_to_fp8).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def read(data: str, out: str, max_len: str, hidden_size: str, layers: str) -> None:
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.recovery import SampleUnavailable

    dataset = ArrowDataset(max_len=int(max_len), datapath=data, on_missing="raise",
                           hidden_states_dtype=torch.float32)
    rows, tensors = [], {}
    for index in range(len(dataset)):
        row = dataset[index]
        if isinstance(row, SampleUnavailable):
            raise SystemExit(f"speculators could not use row {index}: {row.reason}")
        rows.append(row)
        for name in ("hidden_states", "verifier_last_hidden_states", "input_ids", "loss_mask"):
            tensors[f"row{index}.{name}"] = row[name].contiguous()
    batch = CollateFn(int(max_len), int(hidden_size), int(layers), dtype=torch.float32)(rows)
    tensors["batch.hidden_states"] = batch["hidden_states"].contiguous()
    save_file(tensors, out)
    print(f"speculators read {len(dataset)} rows")


def capture(model_dir: str, rows: str, data: str, layer_ids: str, fp8_row: str | None = None) -> None:
    from datasets import load_from_disk
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
    from speculators.data_generation.offline import check_hidden_states
    from transformers import AutoModelForCausalLM

    subprocess.run([sys.executable, "-m", "speculators", "prepare-data", "--model", model_dir, "--data", rows,
                    "--output", data, "--seq-length", "4096", "--num-preprocessing-workers", "1"], check=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = [int(i) for i in layer_ids.split(",")]
    prepared, folder = load_from_disk(data), Path(data) / "hidden_states"
    folder.mkdir()
    for index in range(len(prepared)):
        tokens = prepared[index]["input_ids"]
        before_norm = {}
        hook = model.model.norm.register_forward_pre_hook(lambda module, args: before_norm.update(x=args[0]))
        with torch.no_grad():
            states = model(tokens[None], output_hidden_states=True).hidden_states
        hook.remove()
        taps = [states[k][0] for k in ids[:-1]] + [before_norm["x"][0]]
        tensors = {"hidden_states": torch.stack(taps, dim=1).contiguous(), "token_ids": tokens.clone()}
        check_hidden_states(tensors, tokens.tolist())
        if fp8_row is not None and index == int(fp8_row):
            quantised, scales = quantize_tensor_to_fp8(tensors["hidden_states"])
            tensors = {**tensors, "hidden_states": quantised, SCALES_KEY: scales}
        save_file(tensors, str(folder / f"hs_{index}.safetensors"))
    print(f"captured {len(prepared)} rows")


if __name__ == "__main__":
    assert "drafttrain" not in sys.modules
    {"read": read, "capture": capture}[sys.argv[1]](*sys.argv[2:])
