#!/usr/bin/env bash
# The real target and a trained draft for `scripts/gpu/checks.sh OUT real`, in parts small enough for the device
# tool (64 MiB a call, the repository included): the bundled SmolLM2 GGUF and the draft exported for vLLM (a
# self-contained folder, checked by its manifest where it is loaded), tarred, split and hashed under .gpu/.
#
#   bash scripts/gpu/pack.sh RUN_OR_CHECKPOINT      # then one device call per .gpu/part.N (see checks.sh)
set -euo pipefail
draft=${1:?usage: pack.sh RUN_OR_CHECKPOINT}
gguf=$(python3 -c "from drafttrain.targets.loading import builtin_gguf_path; print(builtin_gguf_path('smollm2-135m-instruct'))")
work=$(mktemp -d)
drafttrain export "$draft" --format vllm --out "$work/draft"
cp "$gguf" "$work/"
mkdir -p .gpu && rm -f .gpu/part.*
tar -cf "$work/real.tar" -C "$work" "$(basename "$gguf")" draft
split -b $((30 * 1024 * 1024)) -a 1 --numeric-suffixes=1 "$work/real.tar" .gpu/part.
(cd "$work" && sha256sum real.tar | sed "s#real.tar#/tmp/real.tar#") >.gpu/real.sha256
ls -la .gpu/part.* && rm -rf "$work"
