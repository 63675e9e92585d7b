#!/usr/bin/env bash
# Issue 27: drafttrain's distilled draft model against TRL's GKD trainer, on the same rows, from the same student and
# teacher, for the same training time, each side once per seed; then both measured the same way: our evaluator on
# MT-Bench first turns and on the run's held-out prompts, every draft in one interleaved run, served as plain HF
# folders over the whole vocabulary (as vLLM serves a draft model).
#
#   bash scripts/parity/distill.sh OUT [MINUTES=10]      # SEEDS="0 1" by default
#
# TRL lives in its own venv (TRL_VENV, default /work/venvs/trl; how to install it: scripts/parity/README.md). Run it
# alone on the machine: the sides share a time budget. Every stage resumes: what is done is kept.
set -euo pipefail
out=${1:?usage: distill.sh OUT [MINUTES]}
minutes=${2:-10}
seeds=(${SEEDS:-0 1})
trl_python=${TRL_VENV:-/work/venvs/trl}/bin/python
here=$(dirname "$0")
source "$here/share_run.sh"
run=$out/run
mkdir -p "$out"

# 1. the rows (the EAGLE-3 comparison's conversations and answers), the student before any step, the teacher
[ -e "$run/data/train" ] || drafttrain prepare "$here/distill.yaml" output_dir="$run" >"$out/prepare.log" 2>&1
[ -e "$out/inputs/rows.jsonl" ] || python "$here/gkd_inputs.py" inputs "$run" "$out/inputs" >"$out/inputs.log" 2>&1

# 2. each trainer, each seed, MINUTES of training
drafts=()
for seed in "${seeds[@]}"; do
    dest=$out/drafttrain-s$seed
    if [ ! -e "$dest/checkpoints/latest" ]; then
        share_run "$run" "$dest" ""
        drafttrain train "$here/distill.yaml" output_dir="$dest" seed="$seed" training.time_budget_minutes="$minutes" \
            >"$dest.log" 2>&1
    fi
    [ -e "$dest/plain/config.json" ] || python "$here/gkd_inputs.py" plain \
        "$dest/checkpoints/$(cat "$dest/checkpoints/latest")" "$dest/plain"
    [ -e "$out/trl-s$seed/run.json" ] || "$trl_python" "$here/gkd.py" "$out/inputs" "$out/trl-s$seed" \
        --minutes "$minutes" --seed "$seed" >"$out/trl-s$seed.log" 2>&1
    drafts+=("drafttrain-s$seed=$dest/plain" "trl-s$seed=$out/trl-s$seed/model")
done

# 3. every draft measured the same way: agreement with the target on the held-out rows, then our evaluator, one
# interleaved run per prompt set (the first draft is the report's own; the others are compared by label)
sides=()
for draft in "${drafts[@]:1}"; do sides+=(--compare "$draft@3"); done
evaluate() {  # NAME PROMPT-FLAGS...
    local name=$1
    shift
    [ -e "$out/$name/report.md" ] || drafttrain eval --target smollm2-135m-instruct --draft "${drafts[0]#*=}" \
        --depth 3 "${sides[@]}" "$@" --threads 2 --no-progress --out "$out/$name" >"$out/$name.log" 2>&1
}
evaluate eval-mt_bench --suite mt_bench --turns 1 --num-prompts 8 --max-new-tokens 128
evaluate eval-heldout --questions "$run/data/validation_prompts.jsonl" --num-prompts all --max-new-tokens 96
python "$here/distill_table.py" "$out" "${drafts[@]}"
