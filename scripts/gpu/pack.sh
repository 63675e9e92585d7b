#!/usr/bin/env bash
# The real target and a prepared run's answers for `scripts/gpu/checks.sh OUT real`, in parts small enough for the
# device tool (64 MiB a call, the repository's 20 MiB included): the bundled SmolLM2 GGUF and RUN's regenerated
# answers and draft vocabulary (the recipes' data: the device regenerates only the rows RUN lacks), tarred, split
# and hashed under .gpu/.
#
#   bash scripts/gpu/pack.sh RUN      # then one device call per .gpu/part.N (see checks.sh)
set -euo pipefail
run=${1:?usage: pack.sh RUN}
gguf=$(python3 -c "from drafttrain.targets.loading import builtin_gguf_path; print(builtin_gguf_path('smollm2-135m-instruct'))")
work=$(mktemp -d)
mkdir -p "$work/rows"
cp "$run"/regenerated.jsonl "$run"/regenerated.settings.json "$run"/draft_vocab.safetensors "$work/rows/"
cp "$run"/draft_vocab.safetensors .gpu/  # for `checks.sh OUT cost`, which travels without the parts it does not need
cp "$gguf" "$work/"
mkdir -p .gpu && rm -f .gpu/part.*
tar -cf "$work/real.tar" -C "$work" "$(basename "$gguf")" rows
split -b $((41 * 1024 * 1024)) -a 1 --numeric-suffixes=1 "$work/real.tar" .gpu/part.
(cd "$work" && sha256sum real.tar | sed "s#real.tar#/tmp/real.tar#") >.gpu/real.sha256
ls -la .gpu/part.* && rm -rf "$work"
