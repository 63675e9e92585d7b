#!/usr/bin/env bash
# the comparison in one command: the parallel drafters (DFlash, P-EAGLE, PARD) and EAGLE-3, each trained on
# the longer recipe's data for its 42-minute budget, then every side measured in one evaluation run per setting
# (MT-Bench first turns and the runs' held-out validation prompts, at T=0 and T=0.7) against prompt lookup and
# plain decoding on the same prompts, plus the draft cost per cycle at draft lengths 4, 8 and 16.
#
#   bash scripts/experiments/parallel_drafters/bench_parallel_drafters.sh OUT [KIND ...]      # KIND: dflash peagle pard eagle3 (default: all four)
#
# Env: PROMPTS (8), TOKENS (128), SETTINGS ("mt_bench:0 heldout:0 mt_bench:0.7 heldout:0.7"), FIXED (3: each trained
# side is also run at this fixed depth, so its tau and acceptance per position are measured even where depth auto
# chooses plain decoding).
# Wall time on a 2-core CPU: the data's regeneration (30-41 min, once: the answer store keeps it), 42 min per kind
# (EAGLE-3's recipe is set in epochs: 34-42 min), ~10 min per setting, then ~3 min for the cost table. A rerun skips
# every kind whose training finished and every setting whose report exists.
# Run alone on the machine: the kinds share a wall-clock budget, so a second job would change what each one learns.
set -euo pipefail
out=${1:?usage: bench_parallel_drafters.sh OUT [KIND ...]}
shift
kinds=("$@")
[ ${#kinds[@]} -gt 0 ] || kinds=(dflash peagle pard eagle3)
prompts=${PROMPTS:-8}
tokens=${TOKENS:-128}
fixed=${FIXED:-3}
settings=${SETTINGS:-"mt_bench:0 heldout:0 mt_bench:0.7 heldout:0.7"}
mkdir -p "$out"

declare -A recipes=(
    [dflash]=recipes/smollm2_dflash.yaml
    [peagle]=recipes/smollm2_peagle.yaml
    [pard]=recipes/smollm2_pard.yaml
    [eagle3]=recipes/smollm2_eagle3.yaml
)
# PARD over the whole vocabulary: vLLM drafts from all 49,152 rows, so a loss over the draft vocabulary alone
# leaves it drafting from rows it never trained (BENCHMARKS.md).
declare -A overrides=([pard]="draft_vocab.enabled=false draft.loss_vocab=full")

for kind in "${kinds[@]}"; do
    recipe=${recipes[$kind]:?unknown kind $kind (dflash, peagle, pard, eagle3)}
    run=$out/$kind
    [ -f "$run/train.done" ] && continue
    # shellcheck disable=SC2086  # the kind's overrides are words
    drafttrain prepare "$recipe" output_dir="$run" ${overrides[$kind]:-} >"$out/$kind-prepare.log" 2>&1
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=2 drafttrain train "$recipe" output_dir="$run" wandb.mode=disabled ${overrides[$kind]:-} \
        >"$out/$kind-train.log" 2>&1
    touch "$run/train.done"
done

# Every run holds out the same validation prompts (same data, same seed): one file serves every side.
heldout=$out/${kinds[0]}/data/validation_prompts.jsonl
for kind in "${kinds[@]}"; do
    cmp "$heldout" "$out/$kind/data/validation_prompts.jsonl" || { echo "held-out prompts differ: $kind" >&2; exit 1; }
done

sides=()
for kind in "${kinds[@]}"; do
    sides+=(--compare "$out/$kind@auto" --compare "$out/$kind@$fixed")  # labelled by folder: dflash@auto, dflash@3
done
for setting in $settings; do
    prompts_from=${setting%%:*}
    temperature=${setting##*:}
    if [ "$prompts_from" = heldout ]; then source=(--questions "$heldout"); else source=(--suite "$prompts_from"); fi
    name=eval-$prompts_from-T$temperature
    [ -f "$out/$name/report.json" ] && continue
    drafttrain eval --target smollm2-135m-instruct --proposer prompt_lookup --depth auto "${sides[@]}" \
        --compare prompt_lookup@4 "${source[@]}" --num-prompts "$prompts" --turns 1 \
        --max-new-tokens "$tokens" --temperature "$temperature" --threads 2 --no-progress --out "$out/$name" \
        >"$out/$name.log" 2>&1
done

# The draft cost per cycle at draft lengths 4, 8 and 16 (drafters built fresh: the cost does not depend on training).
vocab=$(ls "$out"/*/draft_vocab.safetensors 2>/dev/null | head -1)
[ -f "$out/block_cost.json" ] || python scripts/experiments/engine/bench_block_cost.py --threads 2 --out "$out/block_cost.json" \
    ${vocab:+--draft-vocab "$vocab"} >"$out/block_cost.log" 2>&1
