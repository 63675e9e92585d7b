"""Prompts for the closed-loop benchmark (scripts/experiments/adapt/closed_loop.sh), from the bundled GSM8K *train* questions
(data/train/gsm8k_train.jsonl; the gsm8k eval suite is GSM8K's test split and is not used):

  traffic.jsonl   questions the round-1 head is served on; its evaluation writes the feedback that round 2 trains on
  heldout.jsonl   the maths run's own 12 held-out prompts, and more questions no round trained on

Both leave out every question the maths run (ROUND1) drew (its regenerated.jsonl ids are line numbers of the
source), and each other; they are taken in file order from line START on.

    python scripts/experiments/adapt/loop_prompts.py ROUND1_RUN OUT_DIR [TRAFFIC=80] [HELDOUT=24] [START=5000]
"""

import argparse
import json
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[3] / "data" / "train" / "gsm8k_train.jsonl"


def main(round1: Path, out: Path, traffic: int, heldout: int, start: int) -> None:
    used = {int(json.loads(line)["id"].rpartition(":")[2])
            for line in (round1 / "regenerated.jsonl").read_text().splitlines() if line.strip()}
    questions = [json.loads(line)["question"] for line in SOURCE.read_text().splitlines()]
    free = [i for i in range(start, len(questions)) if i not in used][: traffic + heldout]
    if len(free) < traffic + heldout:
        raise SystemExit(f"only {len(free)} unused questions from line {start}")
    out.mkdir(parents=True, exist_ok=True)

    def row(i: int) -> str:
        return json.dumps({"question_id": f"gsm8k_train:{i}", "category": "gsm8k_train", "turns": [questions[i]]})

    (out / "traffic.jsonl").write_text("".join(row(i) + "\n" for i in free[:traffic]))
    own = (round1 / "data" / "validation_prompts.jsonl").read_text()
    (out / "heldout.jsonl").write_text(own + "".join(row(i) + "\n" for i in free[traffic:]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("round1", type=Path)
    parser.add_argument("out", type=Path)
    for name, default in (("traffic", 80), ("heldout", 24), ("start", 5000)):
        parser.add_argument(name, type=int, nargs="?", default=default)
    a = parser.parse_args()
    main(a.round1, a.out, a.traffic, a.heldout, a.start)
