"""``drafttrain push EXPORT --repo OWNER/NAME [--private] [--revision BRANCH] [--dry-run]``."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("export", help="a folder written by `drafttrain export`")
    parser.add_argument("--repo", required=True, help="the Hub model repo, OWNER/NAME (created if missing)")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--revision", help="a branch to push to (created if missing; default: main)")
    parser.add_argument("--message", help="the commit message")
    parser.add_argument("--dry-run", action="store_true", help="check the folder and list what would be uploaded")


def run(args: argparse.Namespace) -> int:
    import logging

    from drafttrain.export.hub import check_export, export_files, push_export

    for noisy in ("httpx", "httpx2", "huggingface_hub"):  # one line per HTTP request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)

    folder = Path(args.export)
    built_from = check_export(folder)
    files = export_files(folder)
    print(f"{folder}: a {built_from.get('kind')} draft in the {built_from['format']} format, {len(files)} files, "
          f"{sum(size for _, size in files) / 1e6:.1f} MB")
    if args.dry_run:
        for name, size in files:
            print(f"  {name} ({size:,} bytes)")
        print(f"dry run: nothing uploaded to {args.repo}")
        return 0
    url = push_export(folder, args.repo, private=args.private, revision=args.revision, message=args.message)
    print(f"pushed to {args.repo}: {url}")
    return 0
