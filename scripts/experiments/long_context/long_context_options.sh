#!/usr/bin/env bash
# the comparison: EAGLE-3, EAGLE-3.1 (fc_norm + norm_output) and EAGLE-3 with a sliding-window draft, each
# trained for the same minutes on the same prepared rows (the long recipe's, long rows included), then measured in
# one run per suite against prompt lookup and plain decoding, tau split by context bucket.
#
#   drafttrain prepare recipes/smollm2_eagle3_long.yaml output_dir=PREPARED
#   bash scripts/experiments/long_context/long_context_options.sh PREPARED OUT [MINUTES=10] [WINDOW=1024]
#
# RECIPE=recipes/smollm2_eagle3.yaml with that recipe's prepared run compares the options without long rows.
# TRAIN_EXTRA (recipe overrides for every arm) and EVAL_EXTRA (eval flags) run it elsewhere, e.g. on a GPU
# (scripts/tools/gpu/checks.sh OUT long): TRAIN_EXTRA="target.device=cuda ..." EVAL_EXTRA="--device cuda --dtype float32".
# Run alone on the machine: the arms share a time budget, so a second job would change what each one learns.
set -euo pipefail
prepared=${1:?usage: long_context_options.sh PREPARED OUT [MINUTES] [WINDOW]}
out=${2:?usage: long_context_options.sh PREPARED OUT [MINUTES] [WINDOW]}
minutes=${3:-10}
window=${4:-1024}
recipe=${RECIPE:-recipes/smollm2_eagle3_long.yaml}
mkdir -p "$out"

declare -A arms=(
    [eagle3]="draft.fc_norm=false draft.norm_output=false"
    [eagle31]="draft.fc_norm=true draft.norm_output=true"
    [window]="draft.fc_norm=false draft.norm_output=false draft.sliding_window=$window"
)
for arm in eagle3 eagle31 window; do
    run=$out/$arm
    if [ ! -f "$run/checkpoints/latest" ] && [ ! -L "$run/checkpoints/latest" ]; then
        rm -rf "$run" && mkdir -p "$run"
        cp -r "$prepared/data" "$prepared/draft_vocab.safetensors" "$prepared/prepare_summary.json" "$run/"
        # shellcheck disable=SC2086  # the arm's and TRAIN_EXTRA's overrides are words
        drafttrain train "$recipe" output_dir="$run" training.time_budget_minutes="$minutes" training.epochs=100 \
            training.save_every=100000 eval.every_checkpoint=false wandb.mode=disabled ${arms[$arm]} ${TRAIN_EXTRA:-} \
            >"$out/$arm-train.log" 2>&1
    fi
done

for suite in long_context mt_bench; do
    drafttrain eval --target smollm2-135m-instruct --draft "$out/eagle3" --compare "eagle3.1=$out/eagle31" \
        --compare "window=$out/window" --compare prompt_lookup --suite "$suite" --num-prompts 8 --turns 1 \
        --max-new-tokens "${TOKENS:-48}" --depth 2 --threads 2 --no-progress --out "$out/eval-$suite" ${EVAL_EXTRA:-} \
        >"$out/eval-$suite.log" 2>&1
done
grep -h -A14 "Acceptance by context length" "$out"/eval-*/report.md || true
