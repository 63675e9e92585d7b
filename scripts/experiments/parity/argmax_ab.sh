#!/usr/bin/env bash
# What the offline cache's argmax buys: the
# parity recipe with training.group_by_length, 40 steps, once reading the run's cache (which keeps the target's
# full-vocabulary argmax, so training computes only the draft vocabulary's rows of the head) and once reading the
# same shards behind an index without the argmax (the whole head at every step, as caches written before it do).
# The arms alternate A B A B, each alone on the machine, on the same batches; each prints its tokens/s per window.
#
#   bash scripts/experiments/parity/argmax_ab.sh OUT     # OUT of scripts/experiments/parity/eagle3.sh (OUT/run prepared)
set -euo pipefail
out=${1:?usage: argmax_ab.sh OUT}
here=$(dirname "$0")
source "$here/share_run.sh"
full=$out/features-full
rm -rf "$full" && mkdir -p "$full"
for f in "$out"/run/features/*; do ln -s "$(realpath "$f")" "$full/$(basename "$f")"; done
rm "$full/index.json"
python -c "import json, sys; d = json.load(open(sys.argv[1])); d.pop('argmax'); json.dump(d, open(sys.argv[2], 'w'))" \
    "$out/run/features/index.json" "$full/index.json"
arm() {  # NAME FEATURES
    local dest=$out/ab-$1
    share_run "$out/run" "$dest" "$2"
    drafttrain train "$here/eagle3.yaml" output_dir="$dest" training.group_by_length=true training.log_every=10 \
        --max-steps 40 >"$dest.log" 2>&1
}
for round in 1 2; do
    arm "argmax-$round" "$(realpath "$out/run/features")"
    arm "full-$round" "$full"
done
for name in argmax-1 full-1 argmax-2 full-2; do
    python -c "import json, sys; r = [json.loads(l) for l in open(sys.argv[1]) if 'tokens_per_s' in l]
print(sys.argv[2], 'tokens/s per 10-step window:', [round(x['tokens_per_s']) for x in r])" \
        "$out/ab-$name/metrics.jsonl" "$name"
done
