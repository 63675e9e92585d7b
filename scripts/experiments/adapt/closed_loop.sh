#!/usr/bin/env bash
#, closed loop: the target's accept/reject decisions while the round-1 head serves maths traffic become the
# training signal of round 2.
#   1. the round-1 head (OUT/adapt-fast from scripts/experiments/adapt/run.sh) is evaluated on TRAFFIC fresh GSM8K train
#      questions with --feedback: its answers (the target's own) and the positions where the target refused the
#      draft (scripts/experiments/adapt/loop_prompts.py picks the questions: none the maths run drew)
#   2. round 2 continues the round-1 head on those answers for MINUTES, once with every position weighted alike
#      (loop-w1) and once with the refused positions weighted W (loop-wW): same rows, same schedule
#   3. one evaluation of round 1, both round-2 heads, the general head and prompt lookup on held-out maths (the maths
#      run's 12 held-out prompts and HELDOUT more questions no round trained on), and one on MT-Bench
#
#   bash scripts/experiments/adapt/closed_loop.sh OUT [MINUTES=5] [W=4]      # OUT holds general/ and adapt-fast/
#
# Run alone on the machine (the arms share a time budget). Finished stages are kept.
set -euo pipefail
out=$1
minutes=${2:-5}
weight=${3:-4}
traffic=${TRAFFIC:-80}
heldout=${HELDOUT:-24}
tokens=${TOKENS:-96}
round1=$out/adapt-fast
loop=$out/loop
[ -e "$round1/checkpoints/latest" ] || { echo "no round-1 head in $round1 (ARMS=adapt-fast scripts/experiments/adapt/run.sh)" >&2; exit 2; }
mkdir -p "$loop"
python scripts/experiments/adapt/loop_prompts.py "$round1" "$loop" "$traffic" "$heldout"

if [ ! -s "$loop/feedback/feedback.jsonl" ]; then
    drafttrain eval --target smollm2-135m-instruct --draft "$round1" --questions "$loop/traffic.jsonl" \
        --num-prompts all --max-new-tokens "${FEEDBACK_TOKENS:-160}" --depth 2 --threads 2 --no-progress \
        --feedback --out "$loop/feedback" >"$loop/feedback.log" 2>&1
fi

arm() {  # NAME WEIGHT: continue the round-1 head on the feedback rows for MINUTES
    local run=$loop/$1
    if [ ! -e "$run/checkpoints/latest" ]; then
        local source="{path: $loop/feedback/feedback.jsonl, format: request_log, rejected_weight: $2}"
        drafttrain prepare scripts/experiments/adapt/math.yaml output_dir="$run" "data.sources=[$source]" \
            data.validation_fraction=0.0 >"$loop/$1-prepare.log" 2>&1
        drafttrain train scripts/experiments/adapt/math.yaml output_dir="$run" "data.sources=[$source]" \
            data.validation_fraction=0.0 draft.init_from="$round1" training.time_budget_minutes="$minutes" \
            >"$loop/$1-train.log" 2>&1
    fi
}
arm loop-w1 1
arm "loop-w$weight" "$weight"

sides=(--compare "loop-w1=$loop/loop-w1" --compare "loop-w$weight=$loop/loop-w$weight" --compare "general=$out/general"
       --compare prompt_lookup)
drafttrain eval --target smollm2-135m-instruct --draft "$round1" "${sides[@]}" --questions "$loop/heldout.jsonl" \
    --num-prompts all --max-new-tokens "$tokens" --depth 2 --threads 2 --no-progress --out "$loop/eval-math" \
    >"$loop/eval-math.log" 2>&1
drafttrain eval --target smollm2-135m-instruct --draft "$round1" "${sides[@]}" --suite mt_bench --num-prompts 8 \
    --turns 1 --max-new-tokens "$tokens" --depth 2 --threads 2 --no-progress --out "$loop/eval-mt_bench" \
    >"$loop/eval-mt_bench.log" 2>&1
grep -h -B2 -A14 "^## Results" "$loop"/eval-*/report.md || true
