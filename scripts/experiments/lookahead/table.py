"""The study's table from the runs of run.sh: per suite and lookahead setting, each side's τ, speedup with its 95%
interval over prompts, the tokens a verification fed (plain decoding feeds 1) and greedy agreement, and whether the
machine was busy.

    python scripts/experiments/lookahead/table.py runs/lookahead
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def interval(ci) -> str:
    return f"{ci[0]:.2f}–{ci[1]:.2f}" if ci else "—"


def rows(report: dict) -> list[tuple]:
    config, overall = report["config"], report["overall"]
    own = config["proposer_kwargs"]
    setting = f"W{own['lookahead_window']} N{own['lookahead_ngram']} G{own['lookahead_pool']}"
    busy = "busy" if (config.get("machine_load") or {}).get("contended") else ""
    out = [(config["suite"], setting, "lookahead", config["depth"], overall["tau"], overall["speedup"],
            interval(overall["speedup_ci95"]), overall["tokens_per_verification"], overall["greedy_match"], busy)]
    for side in config["compare"]:
        line = report["comparisons"][side["label"]]
        out.append((config["suite"], setting, side["label"], side["depth"], line["tau"], line["speed_vs_baseline"],
                    interval(line["speed_vs_baseline_ci95"]), line["tokens_per_verification"],
                    line["greedy_match_vs_baseline"], busy))
    return out


def main(folder: str) -> None:
    print("| suite | setting | side | depth | τ | speedup | 95% interval | tokens per verification | greedy match | |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in sorted(Path(folder).glob("*/report.json")):
        for suite, setting, side, depth, tau, speed, ci, fed, greedy, busy in rows(json.loads(path.read_text())):
            print(f"| {suite} | {setting} | {side} | {depth} | {tau:.2f} | {speed:.2f}× | {ci} | {fed:.1f} | "
                  f"{greedy:.0%} | {busy} |")


if __name__ == "__main__":
    main(sys.argv[1])
