"""Response regeneration: the target rewrites the assistant turns (self-distillation data).

A drafter is trained to predict what the *target* would say, so the responses in public datasets (written by
other models or people) are replaced by the target's own answers. For each conversation the turns are walked
in order; every answer slot gets the target's answer given the history so far, *including the answers already
regenerated for earlier turns* (so later turns stay coherent with the new earlier ones).

Answer slots:
  * every assistant text turn (its content is replaced);
  * after a user turn that is directly followed by another user turn, and after a final user or tool turn (an
    answer is inserted). This covers prompt-only conversations (FastChat question files, ``needs_response``):
    a multi-turn MT-Bench item becomes user, answer, user, answer.

Tool conversations: tool calls (assistant turns carrying ``tool_calls``/``function_call``) and tool results
(``tool`` turns) are kept exactly as given, and only the assistant *text* turns are regenerated. The target
cannot execute the tools, so inventing new calls would need fake observations; keeping the recorded call and
its result and regenerating the text that reads them keeps the conversation consistent.

Output: a jsonl file, one finished conversation per line (the original ``id``, ``source`` and other keys, plus
``regenerated_by``, ``finish_reason`` = ``length`` if any answer hit ``max_new_tokens`` else ``stop``,
``generated_tokens``, ``prompt_hash``); an answer cut at ``max_new_tokens`` carries ``"truncated": true``.
Beside it, ``<name>.settings.json`` records the generation settings and
``<name>.dropped.jsonl`` lists the ids dropped (with the reason) so a rerun does not retry them.

Resumable: each finished row is appended with flush + fsync. A rerun reads the file, skips the ids already
done and appends the rest; a truncated last line (the process was killed mid-write) is cut off and that row is
regenerated. Rerunning with different settings into the same file raises instead of mixing two distributions.

Sampling (temperature > 0) is reproducible per row: the noise comes from a generator seeded with
hash(seed, id, turn), applied with the Gumbel-max trick inside a greedy ``generate``. ``do_sample=True`` would
draw from one global stream shared by the whole batch, so a row's answer would depend on which rows happened
to share its batch, and a resumed run would not reproduce an uninterrupted one.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from drafttrain import DrafttrainError
from drafttrain.config import RegenerateConfig
from drafttrain.cpu_linear import PackedLinears
from drafttrain.data.chat import (
    chat_template_text,
    prompt_ids,
    stop_token_ids,
    tool_definitions,
)
from drafttrain.runfolder import cache_root, write_text_atomic
from drafttrain.sampling import Sampling, warp_logits

log = logging.getLogger(__name__)

TOOL_CALL_KEYS = ("tool_calls", "function_call")


# --------------------------------------------------------------------------------------------------------------
# Settings and per-row seeds


@dataclasses.dataclass(frozen=True)
class RegenerationSettings:
    """What decides the generated answers; stored beside the output and compared on every rerun."""

    target: str
    backend: str
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    # Hash of the chat template the prompts were rendered with (hf backend; the server's own for openai: None).
    chat_template: str | None = None

    @classmethod
    def from_config(
        cls, cfg: RegenerateConfig, target_name: str, seed: int, tokenizer=None
    ) -> "RegenerationSettings":
        model = (cfg.served_model or target_name) if cfg.backend == "openai" else target_name
        return cls(
            target=model,
            backend=cfg.backend,
            temperature=float(cfg.temperature),
            # top_p has no effect in greedy decoding; normalise it so a greedy rerun does not trip the check.
            top_p=float(cfg.top_p) if cfg.temperature > 0 else 1.0,
            max_new_tokens=int(cfg.max_new_tokens),
            seed=int(seed),
            chat_template=template_hash(tokenizer) if cfg.backend == "hf" and tokenizer is not None else None,
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def template_hash(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def row_seed(seed: int, conversation_id: str, turn: int) -> int:
    """A 63-bit seed that depends only on (recipe seed, id, answer slot): stable across batching and resumes."""
    digest = hashlib.sha256(f"{seed}|{conversation_id}|{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def prompt_hash(conversation: dict) -> str:
    """Hash of what the output row was derived from: a changed source row with a reused id is detected."""
    payload = json.dumps(
        {"messages": conversation.get("messages"), "tools": conversation.get("tools")},
        sort_keys=True,
        ensure_ascii=False,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------------------
# Output files (jsonl + settings sidecar + dropped-ids sidecar)


@dataclasses.dataclass(frozen=True)
class OutputPaths:
    rows: Path
    settings: Path
    dropped: Path

    @classmethod
    def for_output(cls, path: str | Path) -> "OutputPaths":
        path = Path(path)
        stem = path.name[: -len(".jsonl")] if path.name.endswith(".jsonl") else path.name
        return cls(
            rows=path,
            settings=path.with_name(stem + ".settings.json"),
            dropped=path.with_name(stem + ".dropped.jsonl"),
        )


def read_jsonl_resumable(path: Path) -> list[dict]:
    """Read the rows written so far; cut off a truncated last line (a kill mid-write) so appending can go on.

    Only the last line may be damaged: rows are appended one at a time with fsync, so a broken line anywhere
    else means the file was edited or corrupted, and that is an error rather than something to guess around.
    """
    if not path.is_file():
        return []
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1  # a tail without its newline is a row whose write was cut: never complete
    lines = data[:keep].split(b"\n")[:-1]
    rows: list[dict] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            if number < len(lines):
                raise DrafttrainError(f"{path}: line {number} is not valid JSON ({err}); the file is corrupt") from None
            keep -= len(line) + 1  # the last complete line is damaged too: redo that row as well
            break
        rows.append(row)
    if keep < len(data):
        log.warning("%s: cutting a truncated last line (%d bytes); that row will be redone", path, len(data) - keep)
        with open(path, "r+b") as handle:
            handle.truncate(keep)
            handle.flush()
            os.fsync(handle.fileno())
    return rows


def append_jsonl(handle, row: dict) -> None:
    """Append one row durably: after this returns, a kill cannot lose it."""
    handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    handle.flush()
    os.fsync(handle.fileno())


def check_settings(paths: OutputPaths, settings: RegenerationSettings, has_rows: bool) -> None:
    """Refuse to append to a file generated with other settings; record the settings for a new file."""
    wanted = settings.as_dict()
    if paths.settings.is_file():
        try:
            recorded = json.loads(paths.settings.read_text())
        except ValueError:
            raise DrafttrainError(f"{paths.settings} is not valid JSON; delete it together with {paths.rows}") from None
        if recorded != wanted and has_rows:
            changed = ", ".join(
                f"{key}: {recorded.get(key)!r} in the file, {wanted.get(key)!r} now"
                for key in sorted(set(recorded) | set(wanted))
                if recorded.get(key) != wanted.get(key)
            )
            raise DrafttrainError(
                f"{paths.rows} was generated with other settings ({changed}). Mixing answers from two settings "
                "would silently change the training distribution: use another output directory, restore the "
                "settings, or delete the file to regenerate from scratch."
            )
        if recorded == wanted:
            return
    elif has_rows:
        raise DrafttrainError(
            f"{paths.rows} has rows but no settings file ({paths.settings.name}), so it cannot be checked "
            "against the current settings; delete it or move it away"
        )
    write_text_atomic(paths.settings, json.dumps(wanted, indent=2) + "\n")


# --------------------------------------------------------------------------------------------------------------
# Answer slots


def is_tool_call(message: dict) -> bool:
    return any(message.get(key) for key in TOOL_CALL_KEYS)


def answer_slots(messages: Sequence[dict]) -> list[tuple[int, bool]]:
    """Where the target answers: (index in messages, True = replace the assistant turn there / False = insert)."""
    slots: list[tuple[int, bool]] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        nxt = messages[i + 1].get("role") if i + 1 < len(messages) else None
        if role == "assistant" and not is_tool_call(message):
            slots.append((i, True))
        elif role == "user" and nxt == "user":
            slots.append((i + 1, False))
        elif role in ("user", "tool") and nxt is None:
            slots.append((i + 1, False))
    return slots


@dataclasses.dataclass
class Generation:
    text: str
    finish_reason: str  # "stop" | "length"
    num_tokens: int


@dataclasses.dataclass
class ConversationJob:
    """One conversation being regenerated, slot after slot."""

    conversation: dict
    slots: list[tuple[int, bool]]
    messages: list[dict] = dataclasses.field(default_factory=list)
    next_slot: int = 0
    shift: int = 0  # how many answers were inserted so far (original indices move right)
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    generated_tokens: int = 0
    drop_reason: str | None = None
    kept_original: int = 0

    def __post_init__(self) -> None:
        self.messages = [dict(m) for m in self.conversation["messages"]]

    @property
    def done(self) -> bool:
        return self.drop_reason is not None or self.next_slot >= len(self.slots)

    def pending_prompt(self) -> list[dict]:
        index, _ = self.slots[self.next_slot]
        return self.messages[: index + self.shift]

    def accept(self, generation: Generation, keep_original_on_empty: bool) -> None:
        index, replaces = self.slots[self.next_slot]
        at = index + self.shift
        self.next_slot += 1
        self.generated_tokens += generation.num_tokens
        self.finish_reasons.append(generation.finish_reason)
        text = generation.text.strip()
        if not text:
            original = self.messages[at].get("content") if replaces else None
            if keep_original_on_empty and original:
                self.kept_original += 1
                return  # the dataset's answer stays in place
            self.drop_reason = "empty_answer_no_original" if keep_original_on_empty else "empty_answer"
            return
        answer = {**self.messages[at], "content": text} if replaces else {"role": "assistant", "content": text}
        answer.pop("truncated", None)
        if generation.finish_reason == "length":
            # Cut at max_new_tokens: the end-of-turn that the chat template adds after it was never generated.
            answer["truncated"] = True
        if replaces:
            self.messages[at] = answer
        else:
            self.messages.insert(at, answer)
            self.shift += 1

    def result(self, settings: RegenerationSettings) -> dict:
        answer = {"messages": self.messages, "finish_reason": "length" if "length" in self.finish_reasons else "stop",
                  "generated_tokens": self.generated_tokens}
        if self.kept_original:
            answer["kept_original_answers"] = self.kept_original
        return answered_row(self.conversation, answer, settings)


def answered_row(conversation: dict, answer: dict, settings: RegenerationSettings) -> dict:
    """The output row of a conversation with the target's answers (``answer``: messages, finish_reason, ...)."""
    row = {**conversation, **answer}
    row["needs_response"] = False  # every user turn has its answer now
    row["regenerated_by"] = settings.target
    row["prompt_hash"] = prompt_hash(conversation)
    return row


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


# --------------------------------------------------------------------------------------------------------------
# HF backend: batched generate with left padding


class SeededGumbelSampling:
    """Logits processor for reproducible per-row sampling inside a greedy ``generate``.

    argmax(warped logits + Gumbel noise) is an exact sample from the warped distribution (drafttrain.sampling).
    Each row draws its noise from its own generator, so its answer does not depend on its batch-mates.
    """

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float):
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self.sampling = Sampling(temperature, top_p)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = warp_logits(scores, self.sampling)
        uniform = torch.stack([torch.rand(scores.shape[-1], generator=g) for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp_(1e-10, 1.0 - 1e-7)))
        return scores + gumbel.to(scores.device)


class HFGenerator:
    """Generate with a local transformers model: batches of prompts, left-padded."""

    def __init__(self, model, tokenizer, settings: RegenerationSettings):
        from transformers import GenerationConfig

        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        chat_template_text(tokenizer)  # the answers must be rendered as training will render them
        self.stop_ids = stop_token_ids(tokenizer, model.generation_config)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.pad_id = int(pad)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        # An explicit config, so generation defaults shipped with the model (temperature, top_k...) never apply.
        self.generation_config = GenerationConfig(
            max_new_tokens=settings.max_new_tokens,
            do_sample=False,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
        )

    def prompt_fits(self, prompt_ids: list[int]) -> bool:
        return self.max_positions is None or len(prompt_ids) + self.settings.max_new_tokens <= self.max_positions

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Generation]:
        from transformers import LogitsProcessorList

        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        processors = LogitsProcessorList()
        if self.settings.temperature > 0:
            processors.append(SeededGumbelSampling(seeds, self.settings.temperature, self.settings.top_p))
        with PackedLinears(self.model):  # on a CPU, oneDNN's packed kernels: faster at every batch width here
            output = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=self.generation_config,
                logits_processor=processors,
            )
        return [self._decode(seq) for seq in output[:, width:].tolist()]

    def _decode(self, new_tokens: list[int]) -> Generation:
        stops = set(self.stop_ids)
        for position, token in enumerate(new_tokens):
            if token in stops:
                text = self.tokenizer.decode(new_tokens[:position], skip_special_tokens=True)
                return Generation(text, "stop", position + 1)
        return Generation(self.tokenizer.decode(new_tokens, skip_special_tokens=True), "length", len(new_tokens))


def _first_prompt_chars(job: ConversationJob) -> int:
    """Length of the first prompt in characters: a cheap stand-in for its token count, to group similar rows."""
    upto = job.slots[0][0] if job.slots else 0
    return sum(len(m.get("content") or "") for m in job.messages[:upto])


def run_hf(
    jobs: list[ConversationJob],
    generator: HFGenerator,
    cfg: RegenerateConfig,
    settings: RegenerationSettings,
    on_done: Callable[[ConversationJob], None],
) -> None:
    """Regenerate ``jobs`` in batches of ``cfg.batch_size`` conversations; each round answers one slot of each.

    Conversations with as many turns and similar lengths share a batch (less padding, no single-turn row waiting
    for a long multi-turn one). Rows are written as they finish, so this order never shows in the results.
    """
    jobs = sorted(jobs, key=lambda job: (len(job.slots), _first_prompt_chars(job)))
    for start in range(0, len(jobs), cfg.batch_size):
        batch = jobs[start : start + cfg.batch_size]
        for job in batch:
            if job.done:  # nothing to answer (e.g. only tool calls)
                on_done(job)
        active = [job for job in batch if not job.done]
        while active:
            prompts, seeds, ready = [], [], []
            for job in active:
                ids = prompt_ids(generator.tokenizer, job.pending_prompt(), job.conversation.get("tools"))
                if not generator.prompt_fits(ids):
                    job.drop_reason = "prompt_too_long"
                    on_done(job)
                    continue
                prompts.append(ids)
                seeds.append(row_seed(settings.seed, str(job.conversation["id"]), job.next_slot))
                ready.append(job)
            if ready:
                for job, generation in zip(ready, generator.generate(prompts, seeds)):
                    job.accept(generation, cfg.keep_original_on_empty)
                    if job.done:
                        on_done(job)
            active = [job for job in ready if not job.done]


# --------------------------------------------------------------------------------------------------------------
# OpenAI-compatible backend (vLLM, SGLang): /v1/chat/completions with a thread pool


def chat_completions_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base + "/chat/completions" if base.endswith("/v1") else base + "/v1/chat/completions"


class OpenAIChatClient:
    """Minimal client for an OpenAI-compatible chat endpoint over urllib (no extra dependency).

    The API key is read from the environment variable named in the recipe and only ever put in the request
    header; it is never logged or written anywhere.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        settings: RegenerationSettings,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = 600.0,
        retries: int = 3,
    ):
        self.url = chat_completions_url(base_url)
        self.model = model
        self.settings = settings
        self._api_key = os.environ.get(api_key_env) or None
        self.timeout_s = timeout_s
        self.retries = retries
        key_note = f"from ${api_key_env}" if self._api_key else "not set"
        log.info("openai backend: %s, model %r, api key %s", self.url, model, key_note)

    def request_body(self, messages: list[dict], tools: list | None, seed: int) -> dict:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": wire_messages(messages),
            "temperature": self.settings.temperature,
            "top_p": self.settings.top_p,
            "max_tokens": self.settings.max_new_tokens,
            "seed": seed % (2**31),  # servers take a 32-bit seed
        }
        if tools:
            body["tools"] = tools
        return body

    def complete(self, messages: list[dict], tools: list | None, seed: int) -> Generation:
        payload = json.dumps(self.request_body(messages, tools, seed)).encode()
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        delay = 1.0
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.url, data=payload, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return parse_chat_completion(json.loads(response.read()))
            except urllib.error.HTTPError as err:
                detail = err.read()[:300].decode(errors="replace")
                retryable = err.code == 429 or err.code >= 500
                if not retryable or attempt == self.retries:
                    raise DrafttrainError(f"{self.url} answered HTTP {err.code}: {detail}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                if attempt == self.retries:
                    reason = getattr(err, "reason", err)
                    raise DrafttrainError(f"cannot reach {self.url}: {reason}") from None
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")


def wire_messages(messages: list[dict]) -> list[dict]:
    """Messages in the chat API's shape: tool-call arguments as JSON text, ids linking each tool result to its call.

    Datasets rarely carry call ids, so calls get ``call_<n>`` and each tool result answers the oldest open call.
    Dataset bookkeeping keys are not sent.
    """
    out: list[dict] = []
    open_calls: list[str] = []
    number = 0
    for message in messages:
        wire: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                fn = call.get("function", call)
                arguments = fn.get("arguments", {})
                call_id = call.get("id") or f"call_{number}"
                number += 1
                if not isinstance(arguments, str):  # the API carries arguments as JSON text
                    arguments = json.dumps(arguments, ensure_ascii=False)
                function = {"name": fn["name"], "arguments": arguments}
                calls.append({"id": call_id, "type": "function", "function": function})
                open_calls.append(call_id)
            wire["tool_calls"] = calls
        elif message["role"] == "tool":
            fallback = open_calls.pop(0) if open_calls else f"call_{number}"
            wire["tool_call_id"] = message.get("tool_call_id") or fallback
        out.append(wire)
    return out


def wire_tools(conversation: dict) -> list | None:
    """The conversation's tool definitions as an OpenAI ``tools`` list (datasets often store them as JSON text)."""
    tools, _raw_text = tool_definitions(conversation.get("tools"))
    return tools


def parse_chat_completion(data: dict) -> Generation:
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise DrafttrainError(f"unexpected chat completion response (no choices): {str(data)[:200]}") from None
    text = (choice.get("message") or {}).get("content") or ""
    finish = "length" if choice.get("finish_reason") == "length" else "stop"
    tokens = (data.get("usage") or {}).get("completion_tokens") or 0
    return Generation(text=text, finish_reason=finish, num_tokens=int(tokens))


def run_openai(
    jobs: list[ConversationJob],
    client: OpenAIChatClient,
    cfg: RegenerateConfig,
    settings: RegenerationSettings,
    on_done: Callable[[ConversationJob], None],
) -> None:
    """Each worker regenerates whole conversations (turns are sequential); rows are written by this thread."""

    def work(job: ConversationJob) -> ConversationJob:
        while not job.done:
            seed = row_seed(settings.seed, str(job.conversation["id"]), job.next_slot)
            generation = client.complete(job.pending_prompt(), wire_tools(job.conversation), seed)
            job.accept(generation, cfg.keep_original_on_empty)
        return job

    with concurrent.futures.ThreadPoolExecutor(max_workers=cfg.batch_size) as pool:
        futures = [pool.submit(work, job) for job in jobs]
        try:
            for future in concurrent.futures.as_completed(futures):
                on_done(future.result())
        except BaseException:
            for future in futures:
                future.cancel()
            raise


# --------------------------------------------------------------------------------------------------------------
# Driver


@dataclasses.dataclass
class RegenerationResult:
    conversations: list[dict]  # in input order; dropped rows left out
    path: Path
    reused: int  # rows found already done in the output (resume)
    from_store: int  # rows answered in an earlier run (of any recipe), taken from the answer store
    regenerated: int  # rows generated in this call
    dropped: dict[str, int]  # reason -> count, over all input rows (old and new)
    generated_tokens: int  # in this call
    seconds: float  # generation time in this call
    finish_reasons: dict[str, int]  # over the kept rows
    kept_original_answers: int  # empty answers replaced by the dataset's (keep_original_on_empty), kept rows

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def stats(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "conversations": len(self.conversations),
            "reused_from_previous_run": self.reused,
            "reused_from_answer_store": self.from_store,
            "regenerated_now": self.regenerated,
            "dropped": dict(self.dropped),
            "finish_reason": dict(self.finish_reasons),
            "kept_original_answers": self.kept_original_answers,
            "generated_tokens": self.generated_tokens,
            "seconds": round(self.seconds, 2),
            "tokens_per_second": round(self.tokens_per_second, 2),
        }


def _check_unique_ids(conversations: Iterable[dict]) -> None:
    seen: set[str] = set()
    for conversation in conversations:
        cid = conversation.get("id")
        if cid is None:
            raise DrafttrainError("every conversation needs an 'id' to make regeneration resumable")
        if str(cid) in seen:
            raise DrafttrainError(f"conversation id {cid!r} occurs twice; ids must be unique to resume safely")
        seen.add(str(cid))


def _index_done(rows: list[dict], wanted: dict[str, dict], where: Path) -> dict[str, dict]:
    """Rows already written, by id; a reused id whose source conversation changed is an error, not a skip."""
    done: dict[str, dict] = {}
    for row in rows:
        cid = str(row.get("id"))
        if cid in done:
            raise DrafttrainError(f"{where}: id {cid!r} appears twice; the file was not written by this tool")
        done[cid] = row
        source = wanted.get(cid)
        if source is not None and row.get("prompt_hash") != prompt_hash(source):
            raise DrafttrainError(
                f"{where}: the row for id {cid!r} was generated from a different conversation than the one with "
                "that id now (the input data changed); regenerate into a fresh output file"
            )
    return done


def regenerate_conversations(
    conversations: Sequence[dict],
    cfg: RegenerateConfig,
    output_path: str | Path,
    *,
    seed: int,
    target=None,
    target_name: str | None = None,
    progress: bool = True,
    on_row: Callable[[dict], None] | None = None,
) -> RegenerationResult:
    """Replace the assistant turns of ``conversations`` with the target's answers, resumably, into ``output_path``.

    ``target`` (a :class:`drafttrain.targets.Target`) is needed for ``backend: hf``; ``target_name`` (default:
    ``target.name``) is what the settings record. ``on_row`` is called after each row is durably written (tests
    use it to interrupt a run). Returns the regenerated conversations in input order.
    """
    from tqdm.auto import tqdm

    if target_name is None:
        if target is None:
            raise DrafttrainError("regenerate_conversations needs a target or a target_name")
        target_name = target.name
    tokenizer = target.tokenizer if target is not None else None
    settings = RegenerationSettings.from_config(cfg, target_name, seed, tokenizer)
    paths = OutputPaths.for_output(output_path)
    paths.rows.parent.mkdir(parents=True, exist_ok=True)
    _check_unique_ids(conversations)
    wanted = {str(c["id"]): c for c in conversations}

    rows = read_jsonl_resumable(paths.rows)
    dropped_rows = read_jsonl_resumable(paths.dropped)
    check_settings(paths, settings, has_rows=bool(rows or dropped_rows))
    done = _index_done(rows, wanted, paths.rows)
    dropped_ids = {str(r.get("id")): r.get("reason", "unknown") for r in dropped_rows}
    todo = [
        ConversationJob(c, answer_slots(c["messages"]))
        for c in conversations
        if str(c["id"]) not in done and str(c["id"]) not in dropped_ids
    ]
    reused = len(conversations) - len(todo)
    if reused:
        log.info("regenerate: %d of %d conversations already in %s, %d to go",
                 reused, len(conversations), paths.rows, len(todo))
    store = AnswerStore(settings, target.fingerprint if target is not None else None) if cfg.reuse_answers else None

    counters = {"tokens": 0, "regenerated": 0}
    started = time.perf_counter()
    with (
        open(paths.rows, "a", encoding="utf-8") as rows_out,
        open(paths.dropped, "a", encoding="utf-8") as dropped_out,
        open(store.path if store else os.devnull, "a", encoding="utf-8") as store_out,
    ):
        from_store = 0
        if store is not None:
            for cid, row in done.items():  # answers this run already had join the store, for other runs
                if cid in wanted and store.get(wanted[cid]) is None:
                    store.put(store_out, wanted[cid], row)
            for job in list(todo):
                answer = store.get(job.conversation)
                if answer is not None:
                    record = answered_row(job.conversation, answer, settings)
                    append_jsonl(rows_out, record)
                    done[str(job.conversation["id"])] = record
                    todo.remove(job)
                    from_store += 1
            if from_store:
                log.info("regenerate: %d conversations answered in earlier runs (%s)", from_store, store.path)
        bar = tqdm(total=len(todo), desc="regenerate", unit="conv", disable=not progress or not todo)

        def on_done(job: ConversationJob) -> None:
            cid = str(job.conversation["id"])
            counters["tokens"] += job.generated_tokens
            counters["regenerated"] += 1
            if job.drop_reason:
                record = {"id": cid, "reason": job.drop_reason}
                append_jsonl(dropped_out, record)
                dropped_ids[cid] = job.drop_reason
            else:
                record = job.result(settings)
                append_jsonl(rows_out, record)
                done[cid] = record
                if store is not None:
                    store.put(store_out, job.conversation, record)
            bar.update(1)
            bar.set_postfix(tok_s=f"{counters['tokens'] / max(time.perf_counter() - started, 1e-9):.1f}")
            if on_row is not None:
                on_row(record)

        if todo and settings.backend == "hf":
            if target is None:
                raise DrafttrainError("regenerate backend 'hf' needs the target model loaded")
            run_hf(todo, HFGenerator(target.model, target.tokenizer, settings), cfg, settings, on_done)
        elif todo:
            if not cfg.base_url:
                raise DrafttrainError("regenerate.backend is 'openai' but regenerate.base_url is not set")
            client = OpenAIChatClient(cfg.base_url, settings.target, settings, api_key_env=cfg.api_key_env)
            run_openai(todo, client, cfg, settings, on_done)
        bar.close()
    seconds = time.perf_counter() - started

    kept = [done[cid] for cid in wanted if cid in done]
    return RegenerationResult(
        conversations=kept,
        path=paths.rows,
        reused=reused,
        from_store=from_store,
        regenerated=counters["regenerated"],
        dropped=dict(Counter(dropped_ids[cid] for cid in wanted if cid in dropped_ids)),
        generated_tokens=counters["tokens"],
        seconds=seconds if todo else 0.0,
        finish_reasons=dict(Counter(row.get("finish_reason", "stop") for row in kept)),
        kept_original_answers=sum(int(row.get("kept_original_answers", 0)) for row in kept),
    )
