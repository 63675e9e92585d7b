#!/usr/bin/env bash
#, a changed target: SmolLM2 fine-tuned with a LoRA adapter (scripts/experiments/adapt/finetune_target.py: Alpaca's
# written answers), and three heads served with it, in one evaluation run per prompt set:
#   old        the general head of scripts/experiments/adapt/run.sh, trained for the base target, as it is
#   realigned  that head continued for MINUTES on the general rows re-answered by the fine-tuned target
#   fresh      a fresh head trained for the same MINUTES on the same rows
# against prompt lookup and plain decoding of the fine-tuned target.
#
#   bash scripts/experiments/adapt/run.sh OUT            # first: the general head (OUT/general)
#   bash scripts/experiments/adapt/changed_target.sh [OUT=runs/adapt] [MINUTES=8]
#
# Run alone on the machine (the arms share a time budget).
set -euo pipefail
out=${1:-runs/adapt}
minutes=${2:-8}
tokens=${TOKENS:-96}
general=$out/general
tuned=$out/tuned-target
[ -e "$general/checkpoints/latest" ] || { echo "no general head at $general: run scripts/experiments/adapt/run.sh first" >&2; exit 2; }
[ -f "$tuned/adapter_config.json" ] || python scripts/experiments/adapt/finetune_target.py "$tuned" --minutes 10 \
    >"$out/finetune.log" 2>&1
target="smollm2-135m-instruct+$(cd "$tuned" && pwd)"

arm() {  # NAME OVERRIDES...: the general recipe's rows answered by the fine-tuned target, trained MINUTES
    local name=$1 run=$out/$1
    shift
    if [ ! -e "$run/checkpoints/latest" ]; then
        drafttrain prepare scripts/experiments/adapt/general.yaml output_dir="$run" target.adapter="$tuned" "$@" \
            >"$out/$name-prepare.log" 2>&1
        drafttrain train scripts/experiments/adapt/general.yaml output_dir="$run" target.adapter="$tuned" \
            training.time_budget_minutes="$minutes" training.epochs=100 "$@" >"$out/$name-train.log" 2>&1
    fi
}
arm realigned draft.init_from="$general" draft_vocab.enabled=false training.learning_rate=3.0e-4 \
    training.warmup_steps=10
arm fresh

sides=(--compare "realigned=$out/realigned" --compare "fresh=$out/fresh" --compare prompt_lookup)
drafttrain eval --target "$target" --draft "$general" "${sides[@]}" \
    --questions "$out/fresh/data/validation_prompts.jsonl" --num-prompts all --max-new-tokens "$tokens" \
    --depth 2 --threads 2 --no-progress --out "$out/eval-tuned-heldout" >"$out/eval-tuned-heldout.log" 2>&1
drafttrain eval --target "$target" --draft "$general" "${sides[@]}" \
    --suite mt_bench --num-prompts 8 --turns 1 --max-new-tokens "$tokens" --depth 2 \
    --threads 2 --no-progress --out "$out/eval-tuned-mt_bench" >"$out/eval-tuned-mt_bench.log" 2>&1
grep -h -B2 -A12 "^## Results" "$out"/eval-tuned-*/report.md || true
