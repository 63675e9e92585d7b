"""``drafttrain push RUN_OR_EXPORT --repo OWNER/NAME [--format F] [--private] [--revision BRANCH] [--dry-run]``.

An export folder is pushed as it is. A run or checkpoint is exported first (``--format``, default the kind's
first), into ``--out`` or ``<run>/exports/<format>``; ``--dry-run`` stops after writing that folder and its card.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from drafttrain.drafts.registry import formats_by_kind
from drafttrain.export.hub import check_export, check_repo_id, export_files, is_export, push_export
from drafttrain.export.writer import export_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a folder written by `drafttrain export`, or a run or checkpoint to export")
    parser.add_argument("--repo", required=True, help="the Hub model repo, OWNER/NAME (created if missing)")
    parser.add_argument("--format", dest="fmt", help="for a run or checkpoint: the export format (default: the "
                                                     f"kind's first; {formats_by_kind()})")
    parser.add_argument("--out", help="for a run or checkpoint: where to write the export (default: "
                                      "<run>/exports/<format>, replaced)")
    parser.add_argument("--target", help="for a run or checkpoint: the target to load (default: the recorded one)")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--revision", help="a branch to push to (created if missing; default: main)")
    parser.add_argument("--message", help="the commit message")
    parser.add_argument("--dry-run", action="store_true", help="write and check the folder, list what would be "
                                                               "uploaded, upload nothing")


def run(args: argparse.Namespace) -> int:
    for noisy in ("httpx", "httpx2", "huggingface_hub"):  # one line per HTTP request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    check_repo_id(args.repo)  # a dry run checks what the real push would refuse
    folder = Path(args.source)
    if not is_export(folder):
        folder = export_checkpoint(args.source, args.fmt, args.out, args.target)
        print(f"exported {args.source} to {folder}")
    built_from = check_export(folder)
    files = export_files(folder)
    print(f"{folder}: a {built_from.get('kind')} draft in the {built_from['format']} format, {len(files)} files, "
          f"{sum(size for _, size in files) / 1e6:.1f} MB")
    if args.dry_run:
        for name, size in files:
            print(f"  {name} ({size:,} bytes)")
        print(f"dry run: nothing uploaded to {args.repo}; the card is {folder / 'README.md'}")
        return 0
    url = push_export(folder, args.repo, private=args.private, revision=args.revision, message=args.message,
                      built_from=built_from)
    print(f"pushed to {args.repo}: {url}")
    return 0
