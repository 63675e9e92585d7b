"""The prompts of a sweep, as the engine is sent them and as our evaluator decodes them: the same text, tokenised
the same way (the request says whether the server adds special tokens), with the same stop tokens."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from pathlib import Path

from drafttrain.data.chat import prompt_text, stop_token_ids
from drafttrain.data.traffic import Prompt, read_request_log
from drafttrain.evaluation.suites import Suite, load_suite

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BenchPrompts:
    source: str  # what they were read from, for the report
    texts: list[str]
    ids: list[list[int]]
    add_special_tokens: bool
    stop_ids: list[int]

    def request_body(self) -> dict:
        """What every request carries beside the prompt, so the server tokenises and stops as we do."""
        return {"add_special_tokens": self.add_special_tokens, "stop_token_ids": self.stop_ids}

    def write_dataset(self, count: int, path: Path) -> Path:
        """``count`` prompts in order (from the first again when there are fewer), in the load generator's custom
        dataset format: one {"prompt": text} per line."""
        with path.open("w") as out:
            for text in itertools.islice(itertools.cycle(self.texts), count):
                out.write(json.dumps({"prompt": text}) + "\n")
        return path


def bench_prompts(tokenizer, generation_config, suite: str | None, request_log: str | None,
                  num_prompts: int | None) -> BenchPrompts:
    """The first turns of a suite (built-in name or FastChat file; ``num_prompts`` taken a category at a time),
    or the distinct prompts of an OpenAI-format request log (its first ``num_prompts``)."""
    if request_log is None:
        return suite_prompts(tokenizer, generation_config, load_suite(suite).select(num_prompts, turns=1))
    read = read_request_log(request_log)
    if read.skipped or read.duplicates:
        log.warning("%s: %d lines skipped, %d duplicate requests left out%s", request_log, len(read.skipped),
                    read.duplicates, f" (first skipped: {read.skipped[0]})" if read.skipped else "")
    # the file's name only: the report may go on a public model card
    return rendered_prompts(tokenizer, generation_config, read.prompts[:num_prompts],
                            f"request log {Path(request_log).name}")


def suite_prompts(tokenizer, generation_config, chosen: Suite) -> BenchPrompts:
    """The first turns of the questions ``chosen`` (a suite already selected, such as a run's held-out prompts)."""
    prompts = [Prompt(({"role": "user", "content": q.turns[0]},)) for q in chosen.questions]
    return rendered_prompts(tokenizer, generation_config, prompts, f"suite {chosen.name} (first turns)")


def rendered_prompts(tokenizer, generation_config, prompts: list[Prompt], source: str) -> BenchPrompts:
    """``prompts`` rendered with the chat template and tokenised as the server will tokenise them."""
    rendered = [prompt_text(tokenizer, list(p.messages), list(p.tools) if p.tools else None) for p in prompts]
    special = rendered[0][1]
    ids = [tokenizer(text, add_special_tokens=special)["input_ids"] for text, _ in rendered]
    return BenchPrompts(source, [text for text, _ in rendered], ids, special,
                        sorted(stop_token_ids(tokenizer, generation_config)))
