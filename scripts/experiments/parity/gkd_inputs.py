"""What TRL's GKD trainer needs to train on exactly what drafttrain trains on, and a plain copy of a drafttrain
draft model for the evaluation (scripts/experiments/parity/distill.sh).

    python scripts/experiments/parity/gkd_inputs.py inputs RUN OUT        # OUT/rows.jsonl, OUT/student, OUT/teacher
    python scripts/experiments/parity/gkd_inputs.py plain CHECKPOINT OUT  # a drafttrain draft model as a plain HF folder

``inputs`` writes the run's train rows (ids, loss mask and the sha256 of both: scripts/experiments/parity/gkd.py checks them),
the student drafttrain starts from (the recipe's cut of the target, before any step) and the target, each an HF
folder with the target's tokenizer files as drafttrain wrote them (so the evaluator's tokenizer check compares
like with like). ``plain`` drops the checkpoint's drafttrain section, so both sides are served as the engines
serve a draft model: a plain HF folder drafting over the whole vocabulary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM

from drafttrain.config import load_recipe
from drafttrain.drafts import drafter_class
from drafttrain.drafts.continuation import resolved_section
from drafttrain.runfolder import RunFolder, open_dataset
from drafttrain.targets.loading import load_target

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from features import row_digest  # noqa: E402  (a sibling script, not a package)


def inputs(run: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "rows.jsonl", "w") as f:
        for row in open_dataset(run / "data" / "train"):
            ids, mask = list(row["input_ids"]), list(row["loss_mask"])
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask, "sha256": row_digest(ids, mask)}) + "\n")
    recipe = load_recipe(HERE / "distill.yaml", [f"output_dir={run}"])
    target = load_target(recipe.target)
    draft = drafter_class("draft_model").build(resolved_section(recipe.draft), target, RunFolder.of(run))
    for name, model in (("student", draft.student), ("teacher", target.model)):
        model.save_pretrained(str(out / name), safe_serialization=True)
        target.tokenizer.save_pretrained(str(out / name))
    print(f"rows, student ({sum(p.numel() for p in draft.student.parameters()) / 1e6:.1f}M) and teacher -> {out}")


def plain(checkpoint: Path, out: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), use_safetensors=True)
    model.save_pretrained(str(out), safe_serialization=True)
    config = json.loads((out / "config.json").read_text())
    config.pop("drafttrain", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in checkpoint.iterdir():  # the tokenizer files, as the checkpoint holds them
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (out / name.name).write_bytes(name.read_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["inputs", "plain"])
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    (inputs if args.what == "inputs" else plain)(args.source, args.out)


if __name__ == "__main__":
    main()
