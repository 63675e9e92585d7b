"""``drafttrain push RUN_OR_EXPORT --repo OWNER/NAME [--format F] [--private] [--revision BRANCH] [--dry-run]``.

An export folder is pushed as it is. A run or checkpoint is exported first (``--format``, default the kind's
first), into ``--out`` or ``<run>/exports/<format>``; ``--dry-run`` stops after writing that folder and its card.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from drafttrain.runfolder import MANIFEST, RunFolder, find_draft, read_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a folder written by `drafttrain export`, or a run or checkpoint to export")
    parser.add_argument("--repo", required=True, help="the Hub model repo, OWNER/NAME (created if missing)")
    parser.add_argument("--format", dest="fmt", help="for a run or checkpoint: the export format (default: the "
                                                     "kind's first: eagle3/eagle/medusa vllm, draft_model hf)")
    parser.add_argument("--out", help="for a run or checkpoint: where to write the export (default: "
                                      "<run>/exports/<format>, replaced)")
    parser.add_argument("--target", help="for a run or checkpoint: the target to load (default: the recorded one)")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--revision", help="a branch to push to (created if missing; default: main)")
    parser.add_argument("--message", help="the commit message")
    parser.add_argument("--dry-run", action="store_true", help="write and check the folder, list what would be "
                                                               "uploaded, upload nothing")


def is_export(folder: Path) -> bool:
    return (folder / MANIFEST).is_file() and "format" in (read_json(folder / MANIFEST).get("built_from") or {})


def run(args: argparse.Namespace) -> int:
    from drafttrain.export.hub import check_export, export_files, push_export

    for noisy in ("httpx", "httpx2", "huggingface_hub"):  # one line per HTTP request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    folder = Path(args.source)
    if not is_export(folder):
        folder = _export_first(args)
    built_from = check_export(folder)
    files = export_files(folder)
    print(f"{folder}: a {built_from.get('kind')} draft in the {built_from['format']} format, {len(files)} files, "
          f"{sum(size for _, size in files) / 1e6:.1f} MB")
    if args.dry_run:
        for name, size in files:
            print(f"  {name} ({size:,} bytes)")
        print(f"dry run: nothing uploaded to {args.repo}; the card is {folder / 'README.md'}")
        return 0
    url = push_export(folder, args.repo, private=args.private, revision=args.revision, message=args.message)
    print(f"pushed to {args.repo}: {url}")
    return 0


def _export_first(args: argparse.Namespace) -> Path:
    from drafttrain.drafts import saved_kind
    from drafttrain.export import export_draft
    from drafttrain.export.writer import recorded_target
    from drafttrain.targets import load_target

    checkpoint = find_draft(args.source)
    fmt = args.fmt or saved_kind(checkpoint).formats[0]
    run = RunFolder.of_checkpoint(checkpoint) or RunFolder.of(checkpoint)
    out = Path(args.out) if args.out else run.export(fmt)
    target = load_target(args.target or recorded_target(checkpoint))
    export_draft(checkpoint, fmt, out, target, overwrite=args.out is None)
    print(f"exported {checkpoint} as {fmt} to {out}")
    return out
