"""The reference trainers' inputs, from the same tensors drafttrain trains on.

    python scripts/experiments/parity/features.py RUN_DIR OUT_DIR [--layers 2 15 27]

RUN_DIR is a folder ``drafttrain prepare`` wrote with ``training.hidden_states: offline``: its train split (then its
validation split, appended last) are the rows every trainer sees, token for token and mask for mask, and its
offline cache (the target run once, with HF transformers and forward hooks) gives the hidden states, so no trainer
sees a different forward of the target. The validation rows, which the cache does not hold, are run through the
same hooks here. Written:

  OUT_DIR/speculators/         speculators' data folder: an arrow dataset (input_ids, loss_mask, seq_len) and
                               hidden_states/hs_{i}.safetensors = {token_ids [T], hidden_states [T, k+1, H]}: the
                               inputs of the tapped layers, then the last layer's output before the final norm
                               (what speculators' vLLM extractor writes; the draft applies the norm itself)
  OUT_DIR/specforge/dflash/    SpecForge's offline DFlash files: data_{i}.ckpt = {input_ids, loss_mask,
                               hidden_states [T, k*H]} with the same tapped tensors, train rows only (it trains
                               on every file of the folder); the validation rows in specforge/dflash_validation/
  OUT_DIR/specforge/eagle3/    SpecForge's offline EAGLE-3 files: data_{i}.ckpt = {input_ids, loss_mask,
                               hidden_state [1, T, H]: the last layer's output after the final norm, in bf16 (its
                               TargetHead is bf16 and refuses another dtype), aux_hidden_state [1, T, k*H]}; the
                               validation rows in specforge/eagle3_validation/
  OUT_DIR/vocab/               the run's draft vocabulary as speculators reads it (d2t.npy, t2d.npy) and as SpecForge
                               does (vocab_mapping.pt = {d2t, t2d}); SpecForge's DFlash has no draft vocabulary
  OUT_DIR/rows.json            the split sizes and the sha256 of every row's ids and mask, in order: the record every
                               side of a comparison is checked against

speculators holds out the last ``1 - train_data_ratio`` of its rows for validation: pass the ``train_data_ratio``
that rows.json gives, and it validates on exactly the run's validation rows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import datasets
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from drafttrain.progress import progress_bar
from drafttrain.runfolder import open_dataset
from drafttrain.targets.hidden import HiddenStateTap, final_norm
from drafttrain.targets.loading import load_target


def row_digest(ids, mask) -> str:
    return hashlib.sha256(json.dumps([list(map(int, ids)), list(map(int, mask))]).encode()).hexdigest()


def run_rows(run: Path) -> tuple[list[dict], int]:
    """The run's train rows then its validation rows (input_ids, loss_mask), and the count of train rows."""
    train = open_dataset(run / "data" / "train")
    validation = open_dataset(run / "data" / "validation")
    rows = [{"input_ids": list(r["input_ids"]), "loss_mask": list(r["loss_mask"])} for split in (train, validation)
            for r in split]
    return rows, len(train)


def rows_record(rows: list[dict], n_train: int) -> dict:
    digests = [row_digest(r["input_ids"], r["loss_mask"]) for r in rows]
    return {"train_rows": n_train, "validation_rows": len(rows) - n_train,
            "train_lengths": [len(r["input_ids"]) for r in rows[:n_train]],
            "train_data_ratio": train_ratio(n_train, len(rows)),
            "all_rows_sha256": hashlib.sha256("".join(digests).encode()).hexdigest(), "row_sha256": digests}


def train_ratio(n_train: int, n_all: int) -> float:
    """The smallest ratio r (to 1e-6) with int(n_all * r) == n_train: speculators' own split expression."""
    ratio = n_train / n_all + 1e-7
    assert int(n_all * ratio) == n_train, (n_train, n_all, ratio)
    return round(ratio, 7)


def cached_rows(run: Path, layers: list[int], final: int):
    """(row, [tapped..., final]) from the run's offline cache (``training.hidden_states: offline``), in row order."""
    index = json.loads((run / "features" / "index.json").read_text())
    for shard in index["shards"]:
        with safe_open(str(run / "features" / shard["file"]), "pt") as f:
            for row in shard["rows"]:
                yield row, [f.get_tensor(f"row{row}.layer{layer}") for layer in [*layers, final]]


@torch.no_grad()
def computed_rows(target, rows: list[dict], layers: list[int], final: int):
    """The same tensors for rows the cache does not hold (the validation split), by the same hooks."""
    for row in rows:
        ids = torch.tensor(row["input_ids"])[None]
        with HiddenStateTap(target.model, [*layers, final]) as tap:
            target.model(input_ids=ids, use_cache=False, logits_to_keep=1)
            yield [h[0].float() for h in tap.get()]


SPECFORGE_KINDS = ("dflash", "eagle3")  # SpecForge trains on every file of a folder: each kind, train and validation


def write_row(i: int, row: dict, hidden: list[torch.Tensor], norm_weight: torch.Tensor, out: Path,
              split: str = "") -> None:
    """One row in both references' layouts. speculators wants the last layer's output before the final norm and
    applies the norm itself; our cache holds it after the norm (y = x / rms(x) * w). y / w has unit RMS, so the
    norm maps it back to y (to a factor 1/sqrt(1 + eps) of 1 - 5e-6): the draft sees the target's own tensor.
    SpecForge's EAGLE-3 wants it after the norm, as the cache holds it."""
    ids = torch.tensor(row["input_ids"], dtype=torch.long)
    mask = torch.tensor(row["loss_mask"], dtype=torch.long)
    *tapped, final = hidden
    tapped = torch.stack(tapped, dim=1)  # [T, k, H]
    if tapped.shape[0] != ids.numel():
        raise SystemExit(f"row {i}: the cache holds {tapped.shape[0]} positions, the split {ids.numel()}")
    last = final / norm_weight
    save_file({"token_ids": ids, "hidden_states": torch.cat([tapped, last[:, None]], dim=1).contiguous()},
              str(out / "speculators" / "hidden_states" / f"hs_{i}.safetensors"))
    torch.save({"input_ids": ids, "loss_mask": mask, "hidden_states": tapped.flatten(1).contiguous()},
               out / "specforge" / f"dflash{split}" / f"data_{i}.ckpt")
    torch.save({"input_ids": ids, "loss_mask": mask, "hidden_state": final[None].to(torch.bfloat16).contiguous(),
                "aux_hidden_state": tapped.flatten(1)[None].contiguous()},
               out / "specforge" / f"eagle3{split}" / f"data_{i}.ckpt")


def write_features(run: Path, target, rows: list[dict], n_train: int, out: Path, layers: list[int]) -> None:
    (out / "speculators" / "hidden_states").mkdir(parents=True, exist_ok=True)
    for kind in SPECFORGE_KINDS:
        for split in ("", "_validation"):
            (out / "specforge" / f"{kind}{split}").mkdir(parents=True, exist_ok=True)
    final, weight = target.num_layers, final_norm(target.model).weight.detach().float()
    bar = progress_bar(total=len(rows), desc="reference features", unit="row")
    for i, hidden in cached_rows(run, layers, final):
        write_row(i, rows[i], hidden, weight, out)
        bar.update(1)
    for i, hidden in enumerate(computed_rows(target, rows[n_train:], layers, final), start=n_train):
        write_row(i, rows[i], hidden, weight, out, split="_validation")
        bar.update(1)
    bar.close()


def write_vocab(run: Path, out: Path) -> None:
    vocab = load_file(str(run / "draft_vocab.safetensors"))
    (out / "vocab").mkdir(parents=True, exist_ok=True)
    np.save(out / "vocab" / "d2t.npy", vocab["d2t"].numpy())
    np.save(out / "vocab" / "t2d.npy", vocab["t2d"].numpy())
    torch.save({"d2t": vocab["d2t"], "t2d": vocab["t2d"].bool()}, out / "vocab" / "vocab_mapping.pt")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 15, 27])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    args = parser.parse_args(argv)
    rows, n_train = run_rows(args.run)
    args.out.mkdir(parents=True, exist_ok=True)
    # in torch format, as speculators' prepare-data saves it (its loader compares tensors)
    datasets.Dataset.from_list([{**r, "seq_len": len(r["input_ids"])} for r in rows]).with_format("torch") \
        .save_to_disk(str(args.out / "speculators"))
    write_vocab(args.run, args.out)
    write_features(args.run, load_target(args.target), rows, n_train, args.out, args.layers)
    (args.out / "rows.json").write_text(json.dumps({**rows_record(rows, n_train), "layers": args.layers}, indent=1))
    print(f"{len(rows)} rows ({n_train} train) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
