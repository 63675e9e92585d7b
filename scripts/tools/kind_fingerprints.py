"""The sha256 of every file every kind and variant exports, in every format it writes, for a tiny seeded Llama
target with SmolLM2's tokenizer: a refactor that must not change what the kinds write compares two of these.

    python scripts/tools/kind_fingerprints.py OUT.json
    python scripts/tools/kind_fingerprints.py OUT.json --compare BEFORE.json   # exit 1 when any file differs
    python scripts/tools/kind_fingerprints.py --runs RUN_A RUN_B   # two runs' checkpoints, weight for weight
                                                                   # (the quickstart before and after a refactor)
    python scripts/tools/kind_fingerprints.py OUT.json --spelling before-rename   # at a commit before the draft
                                                                   # sections' keys were renamed (parallel, lora)

Files are compared byte for byte but for two things no code of ours decides: the safetensors library writes its
metadata map in a random order (a Rust HashMap), so a .safetensors file is hashed as its header with sorted keys
then its tensor bytes (and the checksums of such files a manifest records are blanked); and a manifest names the
temporary checkpoint folder it was exported from, blanked too.

A JSON file that holds the recipe's draft section (``drafttrain.draft``: a checkpoint's config.json, some exports)
is fingerprinted as the hash of the rest of the file and the section itself; --compare reads an earlier section
through the section's ``upgraded`` (how drafttrain reads a checkpoint saved under earlier key names), so a renamed
key is the one difference it forgives, and only where the saved values are the same (a manifest's checksum and size
of such a file are blanked, the file being compared itself)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from families import family_model  # noqa: E402  (tests/families.py: tiny targets from transformers' classes)

from drafttrain.config import DRAFT_SECTIONS, parse_recipe  # noqa: E402
from drafttrain.drafts import build_drafter  # noqa: E402
from drafttrain.export.writer import export_draft  # noqa: E402
from drafttrain.targets import Target, load_tokenizer  # noqa: E402

# name -> the recipe's draft section (every kind, and each variant and option that changes what is written)
DRAFTS: dict[str, dict] = {
    "eagle3": {"kind": "eagle3", "layers": [1, 2, 3]},
    "eagle3_draft_vocab_layers2": {"kind": "eagle3", "layers": [0, 2, 3], "num_layers": 2},
    "peagle": {"kind": "eagle3", "layers": [1, 2, 3], "parallel": {"depths": 4}},
    "eagle": {"kind": "eagle"},
    "medusa1": {"kind": "medusa", "num_heads": 3},
    "medusa2": {"kind": "medusa", "num_heads": 2, "target_lora": {"target_modules": ["q_proj", "v_proj"], "rank": 4}},
    "draft_model": {"kind": "draft_model", "cut": "every:2"},
    "pard": {"kind": "draft_model", "cut": "every:2", "parallel": {"depths": 4}},
    "dflash": {"kind": "dflash", "num_layers": 1, "block_size": 4},
}
# the same sections in the keys drafttrain read before they were renamed
BEFORE_RENAME: dict[str, dict] = {
    "peagle": {"kind": "eagle3", "layers": [1, 2, 3], "parallel_depths": 4},
    "medusa2": {"kind": "medusa", "num_heads": 2, "lora": {"target_modules": ["q_proj", "v_proj"], "rank": 4}},
    "pard": {"kind": "draft_model", "cut": "every:2", "parallel": 4},
}


def file_hash(path: Path) -> str | dict:
    data = path.read_bytes()
    if path.suffix == ".json" and isinstance(draft := _draft_section(json.loads(data)), dict):
        rest = json.loads(data)
        del rest["drafttrain"]["draft"]
        return {"sha256_without_draft_section": hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest(),
                "draft_section": draft}
    if path.suffix == ".safetensors":
        size = int.from_bytes(data[:8], "little")
        header = json.dumps(json.loads(data[8:8 + size]), sort_keys=True).encode()
        data = header + data[8 + size:]
    elif path.name == "manifest.json":
        manifest = json.loads(data)
        for key in ("checkpoint", "path", "weights_sha256"):  # of a file with the metadata order above
            manifest.get("built_from", {}).pop(key, None)
        manifest["files"] = {name: _blanked(entry, path.parent / name) for name, entry in manifest.get("files", {}).items()}
        data = json.dumps(manifest, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


def _blanked(entry: dict, path: Path) -> dict:
    """A manifest's record of a file whose own fingerprint is not its bytes: a .safetensors file, or a JSON file
    holding a draft section (whose bytes change with a renamed key): fingerprinted as itself above."""
    if path.suffix == ".safetensors":
        return {**entry, "sha256": "-"}
    if path.suffix == ".json" and path.is_file() and _draft_section(json.loads(path.read_bytes())) is not None:
        return {**entry, "sha256": "-", "bytes": "-"}
    return entry


def _draft_section(config) -> dict | None:
    return config.get("drafttrain", {}).get("draft") if isinstance(config, dict) \
        and isinstance(config.get("drafttrain"), dict) else None


def same(before, now) -> bool:
    """Equal fingerprints; of a draft section, the earlier one read as drafttrain reads a saved one."""
    if isinstance(before, dict) and isinstance(now, dict):
        section = next(s for s in DRAFT_SECTIONS if s.model_fields["kind"].default == before["draft_section"]["kind"])
        return before["sha256_without_draft_section"] == now["sha256_without_draft_section"] \
            and section.upgraded(dict(before["draft_section"])) == now["draft_section"]
    return before == now


def fingerprints(spelling: str) -> dict[str, dict]:
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    out: dict[str, dict] = {}
    for name, section in DRAFTS.items():
        section = BEFORE_RENAME.get(name, section) if spelling == "before-rename" else section
        target = Target("llama", family_model("llama"), tokenizer)
        torch.manual_seed(0)
        drafter = build_drafter(parse_recipe({"draft": section}).draft, target)
        with torch.no_grad():
            for param in drafter.parameters():  # every weight random, so a dropped or moved tensor shows
                param.normal_(0, 0.2)
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = drafter.save_pretrained(Path(tmp) / "checkpoint")
            out[f"{name}/checkpoint"] = {p.name: file_hash(p) for p in sorted(checkpoint.iterdir()) if p.is_file()}
            for fmt in drafter.export_formats():
                folder = export_draft(checkpoint, fmt, Path(tmp) / fmt, target)
                out[f"{name}/{fmt}"] = {str(p.relative_to(folder)): file_hash(p)
                                        for p in sorted(folder.rglob("*")) if p.is_file()}
        print(f"{name}: {', '.join(drafter.export_formats())}", flush=True)
    return out


def compare_runs(first: Path, second: Path) -> int:
    """Every checkpoint's weights of two run folders, by the hash above; exit 1 when any differ or are missing."""
    names = sorted({p.relative_to(run) for run in (first, second) for p in run.glob("checkpoints/step-*/*.safetensors")})
    differ = [str(n) for n in names if not ((first / n).is_file() and (second / n).is_file()
                                           and file_hash(first / n) == file_hash(second / n))]
    print(f"{len(names)} checkpoint weight files; {len(differ)} differ" + "".join(f"\n  {d}" for d in differ))
    return 1 if differ or not names else 0


def main() -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":  # a set's order decides the order some weights are drawn in
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?")
    parser.add_argument("--compare", help="an earlier output: report every file that differs")
    parser.add_argument("--spelling", choices=["now", "before-rename"], default="now",
                        help="the draft sections' keys: today's, or those of a commit before they were renamed")
    parser.add_argument("--runs", nargs=2, type=Path, metavar=("RUN_A", "RUN_B"),
                        help="compare two run folders' checkpoint weights instead")
    args = parser.parse_args()
    if args.runs:
        return compare_runs(*args.runs)
    if not args.out:
        parser.error("give OUT.json (or --runs RUN_A RUN_B)")
    now = fingerprints(args.spelling)
    Path(args.out).write_text(json.dumps(now, indent=1, sort_keys=True))
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    differ = [f"{export}/{file}" for export in sorted(set(before) | set(now))
              for file in sorted(set(before.get(export, {})) | set(now.get(export, {})))
              if not same(before.get(export, {}).get(file), now.get(export, {}).get(file))]
    files = sum(len(v) for v in now.values())
    print(f"{files} files in {len(now)} folders; {len(differ)} differ" + "".join(f"\n  {d}" for d in differ))
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
