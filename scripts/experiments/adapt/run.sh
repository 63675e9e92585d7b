#!/usr/bin/env bash
# adapt a general EAGLE-3 head to a shifted domain (maths: GSM8K questions, answered by the target) and
# compare, on held-out maths prompts and on MT-Bench, in one evaluation run per prompt set:
#   general   the head as it was (scripts/experiments/adapt/general.yaml: the longer recipe's mixture without maths)
#   adapt     continued on the maths rows for MINUTES (draft.init_from)
#   replay    the same, with 30% of the train split replayed from the general run's rows (data.replay)
#   lora      continued through draft LoRA adapters (rank 16) instead of all its weights (draft.draft_lora)
#   scratch   a fresh head (the general recipe's start) trained on the maths rows for the same MINUTES
#   adapt-fast  as adapt, at the general head's own learning rate (8e-4 instead of the maths recipe's 3e-4)
#   adapt-vocab as adapt-fast, its draft vocabulary extended by the maths tokens it lacks (draft_vocab.enabled)
#   adapt-offline as adapt-fast, the maths rows' hidden states written once by prepare (training.hidden_states:
#               offline, with the target's argmax), so the minutes train the head instead of running the target
#   scratch-offline as scratch, from the same offline cache (the fair comparison for adapt-offline)
# and prompt lookup, against plain decoding.
#
#   bash scripts/experiments/adapt/run.sh [OUT=runs/adapt] [MINUTES=8]
#   ARMS="adapt adapt-fast scratch" bash scripts/experiments/adapt/run.sh OUT 10    # some arms only (default: the first four)
#   QUESTIONS=OUT/loop/heldout.jsonl ...    # held-out maths prompts (default: the first arm's 12 validation prompts)
#
# OUT/general may be a link to an earlier OUT's general head: it is trained only when absent.
#
# Run alone on the machine: the arms share a time budget, so a second job would change what each one learns.
# Every stage resumes: a finished run is kept, answers come from the answer store after the first prepare.
set -euo pipefail
out=${1:-runs/adapt}
minutes=${2:-8}
tokens=${TOKENS:-96}
general=$out/general
mkdir -p "$out"

trained() { [ -e "$1/checkpoints/latest" ]; }

if ! trained "$general"; then
    drafttrain prepare scripts/experiments/adapt/general.yaml output_dir="$general" >"$out/general-prepare.log" 2>&1
    drafttrain train scripts/experiments/adapt/general.yaml output_dir="$general" >"$out/general-train.log" 2>&1
fi

arm() {  # NAME OVERRIDES...: prepare the maths rows (as the arm needs them) and train MINUTES
    local name=$1 run=$out/$1
    shift
    if ! trained "$run"; then
        drafttrain prepare scripts/experiments/adapt/math.yaml output_dir="$run" "$@" >"$out/$name-prepare.log" 2>&1
        drafttrain train scripts/experiments/adapt/math.yaml output_dir="$run" training.time_budget_minutes="$minutes" "$@" \
            >"$out/$name-train.log" 2>&1
    fi
}
run_arm() {
    case $1 in
        adapt) arm adapt draft.init_from="$general" ;;
        adapt-fast) arm adapt-fast draft.init_from="$general" training.learning_rate=8.0e-4 ;;
        # adapt-fast whose draft vocabulary gains the maths tokens the general one lacks (8% of the answers' tokens)
        adapt-vocab) arm adapt-vocab draft.init_from="$general" training.learning_rate=8.0e-4 draft_vocab.enabled=true ;;
        adapt-offline) arm adapt-offline draft.init_from="$general" training.learning_rate=8.0e-4 \
            training.hidden_states=offline ;;
        replay) arm replay draft.init_from="$general" "data.replay={run: $general, fraction: 0.3}" ;;
        lora) arm lora draft.init_from="$general" "draft.draft_lora={rank: 16, alpha: 32}" training.learning_rate=1.0e-3 ;;
        # the general head's draft vocabulary size (the schema's default, 32,000, made a head twice as slow to train)
        scratch) arm scratch draft_vocab.enabled=true draft_vocab.size=8192 "draft.init_from_target=[lm_head, layer, fc]" \
            training.learning_rate=8.0e-4 training.warmup_steps=30 ;;
        # scratch from the same offline cache: how much of adapt-offline's gain is the general head's start
        scratch-offline) arm scratch-offline draft_vocab.enabled=true draft_vocab.size=8192 \
            "draft.init_from_target=[lm_head, layer, fc]" training.learning_rate=8.0e-4 training.warmup_steps=30 \
            training.hidden_states=offline ;;
        *) echo "unknown arm $1" >&2; exit 2 ;;
    esac
}
arms=(${ARMS:-adapt replay lora scratch})
sides=()
for name in "${arms[@]}"; do
    run_arm "$name"
    sides+=(--compare "$name=$out/$name")
done
sides+=(--compare prompt_lookup)
drafttrain eval --target smollm2-135m-instruct --draft "$general" "${sides[@]}" \
    --questions "${QUESTIONS:-$out/${arms[0]}/data/validation_prompts.jsonl}" --num-prompts all --max-new-tokens "$tokens" --depth 2 \
    --threads 2 --no-progress --out "$out/eval-math" >"$out/eval-math.log" 2>&1
drafttrain eval --target smollm2-135m-instruct --draft "$general" "${sides[@]}" \
    --suite mt_bench --num-prompts 8 --turns 1 --max-new-tokens "$tokens" --depth 2 \
    --threads 2 --no-progress --out "$out/eval-mt_bench" >"$out/eval-mt_bench.log" 2>&1
grep -h -B2 -A12 "^## Results" "$out"/eval-*/report.md || true
