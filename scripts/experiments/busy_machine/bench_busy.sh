#!/usr/bin/env bash
# the measurement: the README's quickstart on a fresh clone with an empty answer store, once with the machine
# alone and once with one single-thread CPU hog running beside it; then (optionally) `drafttrain eval --depth auto` of a
# trained head, alone and with the hog. Prints wall time, the auto choice, its predicted and measured speedup with
# the 95% interval, and whether the report said the machine was busy.
#
#   scripts/experiments/busy_machine/bench_busy.sh OUT_DIR [EVAL_DRAFT]        (QUICKSTARTS="": the evals only; "busy": that quickstart only;
#                                                     EVAL_PROMPTS / EVAL_TOKENS: the eval's size, default 16 / 128)
#
# Run it with nothing else on the machine: the "alone" figures are only alone if the machine is.
set -euo pipefail
out=$(realpath -m "${1:?usage: scripts/experiments/busy_machine/bench_busy.sh OUT_DIR [EVAL_DRAFT]}")
draft=${2:-}
repo=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$out"

hog_pid=
start_hog() { python -c "while True: pass" & hog_pid=$!; sleep 2; }
stop_hog() { [ -n "$hog_pid" ] && kill "$hog_pid" 2>/dev/null || true; hog_pid=; }
trap stop_hog EXIT

summary() {  # report.json -> one line: the auto choice, predicted and measured speedup, interval, busy note
  python - "$1" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
c, o = r["config"], r["overall"]
auto = c.get("depth_auto") or {}
check = c.get("runtime_check") or {}
ci = o.get("speedup_ci95") or [None, None]
print(json.dumps({"proposer": c["proposer"], "chosen_depth": auto.get("depth"),
                  "predicted": auto.get("predicted_speedup"), "measured": o.get("speedup"), "ci95": ci,
                  "tau": o.get("tau"), "runtime_check": [f"{e['from']} -> {e['to']} @{e['cycle']}" for e in
                                                         check.get("switches", [])],
                  "busy_note": (c.get("machine_load") or {}).get("note"),
                  "comparisons": {k: v.get("speed_vs_baseline") for k, v in r.get("comparisons", {}).items()}}))
EOF
}

quickstart() {  # $1: label
  local clone="$out/clone-$1"
  rm -rf "$clone" && git clone -q "$repo" "$clone"
  local started=$SECONDS
  # python -m from the clone runs the clone's code; an empty answer store, as on a new machine
  (cd "$clone" && DRAFTTRAIN_ANSWER_STORE="$out/answers-$1" python -m drafttrain quickstart </dev/null \
    >"$out/quickstart-$1.out" 2>&1) || echo "quickstart $1 exited $?"
  echo "quickstart $1: $(( (SECONDS - started) / 60 )) min $(( (SECONDS - started) % 60 )) s"
  summary "$clone/runs/smollm2_eagle3_quick/eval/report.json"
}

evaluate() {  # $1: label
  local started=$SECONDS
  (cd "$repo" && python -m drafttrain eval --target smollm2-135m-instruct --draft "$draft" --suite mt_bench \
    --num-prompts "${EVAL_PROMPTS:-16}" --turns 1 --max-new-tokens "${EVAL_TOKENS:-128}" --depth auto \
    --compare prompt_lookup@auto --no-progress \
    --out "$out/eval-$1" >"$out/eval-$1.out" 2>&1) || echo "eval $1 exited $?"
  echo "eval $1: $(( (SECONDS - started) / 60 )) min $(( (SECONDS - started) % 60 )) s"
  summary "$out/eval-$1/report.json"
}

for run in ${QUICKSTARTS-alone busy}; do  # QUICKSTARTS="busy" runs that one alone
  if [ "$run" = busy ]; then start_hog; quickstart busy; stop_hog; else quickstart alone; fi
done
if [ -n "$draft" ]; then
  evaluate alone
  start_hog; evaluate busy; stop_hog
fi
