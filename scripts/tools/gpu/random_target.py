"""A target of SmolLM2-135M-Instruct's exact shape and tokenizer with freshly initialised weights, for the GPU checks
whose figures depend on the shape alone (training-step throughput, peak memory against `drafttrain plan`, DeepSpeed
on CUDA). The real weights (a 94 MiB GGUF) travel to the device machine only for the decoding check.

    python scripts/tools/gpu/random_target.py CONFIG_AND_TOKENIZER_DIR OUT_DIR
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a folder with config.json and the tokenizer files")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.source), dtype=torch.float32)
    model.save_pretrained(args.out)  # safetensors
    for name in TOKENIZER_FILES:
        if (args.source / name).is_file():
            shutil.copy(args.source / name, args.out / name)
    print(f"random target: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters in {args.out}")


if __name__ == "__main__":
    main()
