#!/usr/bin/env bash
# lookahead decoding on SmolLM2-135M against plain decoding, prompt lookup and (when given) a trained head: one
# `drafttrain eval` run per suite and lookahead setting, the runs one after another, then the study's table.
#
#   bash scripts/experiments/lookahead/run.sh [OUT=runs/lookahead] [HEAD=a drafttrain run or checkpoint]
#   SETTINGS="5,4,5" SUITES="mt_bench" bash scripts/experiments/lookahead/run.sh OUT      # fewer runs
#
# A setting is W,N,G (window, n-gram size, pool). Each run has lookahead as the method, prompt lookup at the same
# depth (N-1, the run's default depth fitted to lookahead) and, in the first setting's run of each suite, the head
# at that depth, all against the same plain decoding, interleaved prompt by prompt. A finished run is kept.
# Run alone on the machine: the figures are speeds.
set -euo pipefail
out=${1:-runs/lookahead}
head=${2:-}
settings=${SETTINGS:-"5,4,5 3,3,3 7,5,7"}
suites=${SUITES:-"mt_bench long_context humaneval"}
prompts=${PROMPTS:-8}
tokens=${TOKENS:-64}
threads=${THREADS:-1}
mkdir -p "$out"

for suite in $suites; do
  first=1
  for setting in $settings; do
    IFS=, read -r w n g <<< "$setting"
    dir=$out/$suite-w$w-n$n-g$g
    extra=()
    if [ -n "$head" ] && [ "$first" = 1 ]; then extra=(--compare "head=$head"); fi
    first=0
    [ -f "$dir/report.json" ] && continue
    drafttrain eval --target smollm2-135m-instruct --proposer lookahead --lookahead-window "$w" \
      --lookahead-ngram "$n" --lookahead-pool "$g" --compare prompt_lookup "${extra[@]}" --suite "$suite" \
      --num-prompts "$prompts" --max-new-tokens "$tokens" --threads "$threads" --no-progress --out "$dir" \
      > "$dir.log" 2>&1
  done
done
python "$(dirname "$0")/table.py" "$out"
