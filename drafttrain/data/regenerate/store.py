"""The answer store: the target's answers kept across runs and recipes, so none is generated twice."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from drafttrain.data.regenerate.resume import RegenerationSettings, append_jsonl, prompt_hash, read_jsonl_resumable
from drafttrain.runfolder import cache_root

ANSWER_FIELDS = ("messages", "finish_reason", "generated_tokens", "kept_original_answers")


class AnswerStore:
    """The target's answers kept across runs, in the user cache: a conversation the same target answered with the
    same settings is not answered again, whichever run (or recipe) asks. One file per (settings, target weights);
    entries keyed by the conversation's content, plus its id when sampling (its seed depends on the id).

    Where: $DRAFTTRAIN_ANSWER_STORE, else <cache>/answers (drafttrain.runfolder.cache_root)."""

    def __init__(self, settings: RegenerationSettings, target_fingerprint: str | None):
        root = Path(os.environ.get("DRAFTTRAIN_ANSWER_STORE") or cache_root() / "answers")
        identity = json.dumps({**settings.as_dict(), "weights": target_fingerprint}, sort_keys=True)
        self.path = root / f"{hashlib.sha256(identity.encode()).hexdigest()[:16]}.jsonl"
        self.sampling = settings.temperature > 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.answers = {row["key"]: row for row in read_jsonl_resumable(self.path) if "key" in row}

    def key(self, conversation: dict) -> str:
        return prompt_hash(conversation) + (f"|{conversation['id']}" if self.sampling else "")

    def get(self, conversation: dict) -> dict | None:
        stored = self.answers.get(self.key(conversation))
        return None if stored is None else {k: stored[k] for k in ANSWER_FIELDS if k in stored}

    def put(self, handle, conversation: dict, row: dict) -> None:
        entry = {"key": self.key(conversation), **{k: row[k] for k in ANSWER_FIELDS if k in row}}
        append_jsonl(handle, entry)
        self.answers[entry["key"]] = entry
