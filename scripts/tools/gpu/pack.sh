#!/usr/bin/env bash
# The real target, and optionally a prepared run's answers, for `scripts/tools/gpu/checks.sh OUT real|long`, in parts small
# enough for one transfer to the GPU machine (64 MiB, the repository's 20 MiB included): the bundled SmolLM2 GGUF and RUN's
# regenerated answers and draft vocabulary (the recipes' data: the device regenerates only the rows RUN lacks),
# tarred, split and hashed under .gpu/. PARTS_MIB sizes the parts but the last (default "41 41"): the first call also
# carries the wheels (19 MiB), so make its part the smaller, e.g. PARTS_MIB="23 43".
#
#   bash scripts/tools/gpu/pack.sh [RUN]      # then one device call per .gpu/part.N (see checks.sh)
set -euo pipefail
run=${1:-}
gguf=$(python3 -c "from drafttrain.targets.loading import builtin_gguf_path; print(builtin_gguf_path('smollm2-135m-instruct'))")
work=$(mktemp -d)
mkdir -p "$work/rows"
if [ -n "$run" ]; then
    cp "$run"/regenerated.jsonl "$run"/regenerated.settings.json "$run"/draft_vocab.safetensors "$work/rows/"
    cp "$run"/draft_vocab.safetensors .gpu/  # for `checks.sh OUT cost`, which travels without the parts it does not need
fi
cp "$gguf" "$work/"
mkdir -p .gpu && rm -f .gpu/part.*
tar -cf "$work/real.tar" -C "$work" "$(basename "$gguf")" rows
n=1 skip=0
for mib in ${PARTS_MIB:-41 41}; do
    dd if="$work/real.tar" of=.gpu/part.$n bs=1M skip=$skip count="$mib" status=none
    skip=$((skip + mib)) n=$((n + 1))
done
dd if="$work/real.tar" of=.gpu/part.$n bs=1M skip=$skip status=none
(cd "$work" && sha256sum real.tar | sed "s#real.tar#/tmp/real.tar#") >.gpu/real.sha256
ls -la .gpu/part.* && rm -rf "$work"
