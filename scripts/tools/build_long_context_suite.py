"""Build the long-context evaluation suite (eval/long_context.jsonl) and its training counterpart
(data/train/long_context_train.jsonl) from text that ships with Python itself, under the PSF licence:
the standard library's own modules (long code files) and the language reference's topics in ``pydoc_data``
(long documents). Each prompt is one document and a request about it (explain, summarise, document, quiz), sized
to 2k-8k tokens of SmolLM2's tokenizer so it fits the model's 8k context with room for the answer.

    python scripts/tools/build_long_context_suite.py [--check]

Deterministic: files and topics in sorted order, every document cut at a line boundary to its target length. The
eval and training sets never share a file or a topic. ``--check`` rebuilds in memory and fails if the committed
files differ (the interpreter's version is recorded: another Python's stdlib gives other files).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import pydoc_data.topics
import sys
import sysconfig
from pathlib import Path

from drafttrain.targets.loading import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
EVAL_FILE = REPO / "eval" / "long_context.jsonl"
TRAIN_FILE = REPO / "data" / "train" / "long_context_train.jsonl"
TOKENIZER = "smollm2-135m-instruct"
LENGTHS = (2200, 3000, 4000, 5000, 6000, 7500)  # prompt tokens, cycled: every 2k-8k bucket gets prompts
EVAL_PER_CATEGORY = 12
CODE_ASKS = (
    "Explain what this module does, then describe its three most important functions or classes.",
    "Summarise this file for a new contributor: its purpose, its public interface, and anything surprising.",
    "Write Markdown documentation for the public functions and classes of this module.",
)
DOC_ASKS = (
    "Summarise this section of the Python language reference in a few paragraphs.",
    "Using only this text, list the main rules it defines, each with a one-line example.",
    "Write five quiz questions about this text, each followed by its answer taken from the text.",
)


def code_documents() -> list[tuple[str, str]]:
    """(name, text) of the standard library's top-level modules, in name order (private and generated ones out)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [(f"Lib/{p.name}", p.read_text(encoding="utf-8")) for p in sorted(lib.glob("*.py"))
            if not p.name.startswith("_") and "sysconfigdata" not in p.name]


def doc_documents() -> list[tuple[str, str]]:
    return [(f"pydoc_data.topics[{k!r}]", v) for k, v in sorted(pydoc_data.topics.topics.items())]


class Document:
    """A source text as lines with their token counts (counted once), cut to a budget at a line boundary."""

    def __init__(self, tokenizer, name: str, text: str):
        self.name, self.sha256 = name, hashlib.sha256(text.encode()).hexdigest()
        self.lines = text.splitlines(keepends=True)
        self.counts = [len(tokenizer.encode(line, add_special_tokens=False)) for line in self.lines]

    def cut(self, budget: int) -> str | None:
        """The first lines that fit ``budget`` tokens, or None when the text cannot fill nearly all of it."""
        used = 0
        for index, n in enumerate(self.counts):
            if used + n > budget:
                return "".join(self.lines[:index]) if used >= budget - 100 else None
            used += n
        return None  # shorter than the budget: it belongs to a smaller one


def render(kind: str, name: str, body: str, ask: str) -> str:
    if kind == "code":
        return f"Here is the Python file `{name}`:\n\n```python\n{body.rstrip()}\n```\n\n{ask}"
    return f"Here is a section of the Python language reference ({name}):\n\n{body.rstrip()}\n\n{ask}"


def largest_cut(document: Document, budgets) -> tuple[int, str] | None:
    """The largest of ``budgets`` the document fills, and its text cut to it."""
    for budget in sorted(budgets, reverse=True):
        body = document.cut(budget)
        if body is not None:
            return budget, body
    return None


def build(tokenizer) -> tuple[list[dict], list[dict]]:
    """The suite's questions (12 per category, budgets cycled, each from the first unused document that fills its
    budget, or the largest smaller one) and the training rows (every other document, at the largest budget it
    fills)."""
    suite, train = [], []
    for kind, texts, asks in (("code", code_documents(), CODE_ASKS), ("docs", doc_documents(), DOC_ASKS)):
        pool = [Document(tokenizer, name, text) for name, text in texts]
        for index in range(EVAL_PER_CATEGORY):
            wanted = [b for b in LENGTHS if b <= LENGTHS[index % len(LENGTHS)]]
            document, (_, body) = next((d, cut) for d in pool if (cut := largest_cut(d, wanted)) is not None)
            pool.remove(document)
            suite.append({"question_id": f"long_{kind}_{index:02d}", "category": f"long_{kind}",
                          "turns": [render(kind, document.name, body, asks[index % len(asks)])],
                          "source": document.name, "source_sha256": document.sha256})
        for index, document in enumerate(pool):
            found = largest_cut(document, LENGTHS)
            if found is not None:  # prompt-only rows (FastChat format): the target writes the answers
                train.append({"question_id": f"long_{kind}_train_{len(train):03d}", "category": f"long_{kind}",
                              "turns": [render(kind, document.name, found[1], asks[index % len(asks)])],
                              "source": document.name})
    return suite, train


def lines(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed files differ from a rebuild")
    args = parser.parse_args()
    tokenizer = load_tokenizer(TOKENIZER)
    suite, train = build(tokenizer)
    made = {EVAL_FILE: lines(suite), TRAIN_FILE: lines(train)}
    if args.check:
        stale = [str(p) for p, text in made.items() if not p.is_file() or p.read_text() != text]
        print("up to date" if not stale else f"differs from a rebuild: {', '.join(stale)}")
        return 1 if stale else 0
    for path, text in made.items():
        path.write_text(text)
    sizes = sorted(len(tokenizer.encode(q["turns"][0])) for q in suite)
    print(f"{len(suite)} questions ({sizes[0]}-{sizes[-1]} tokens), {len(train)} training rows, from Python "
          f"{platform.python_version()} ({sys.implementation.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
