"""The ``openai`` regeneration backend: an OpenAI-compatible ``/v1/chat/completions`` server (vLLM, SGLang) over
urllib (no extra dependency), with a thread pool; each worker answers a whole conversation, turn after turn."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from drafttrain import DrafttrainError
from drafttrain.config import RegenerateConfig
from drafttrain.data.chat import tool_definitions
from drafttrain.data.regenerate.jobs import AnsweringModel, ConversationJob, Generation
from drafttrain.data.regenerate.resume import RegenerationSettings, row_seed

log = logging.getLogger(__name__)


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


class OpenAIBackend:
    """``regenerate.backend: openai``: an OpenAI-compatible server (vLLM, SGLang) answers, several conversations at
    a time (``batch_size`` workers)."""

    def __init__(self, target: AnsweringModel | None, cfg: RegenerateConfig, settings: RegenerationSettings):
        self.client = OpenAIChatClient(cfg.base_url, settings.target, settings, api_key_env=cfg.api_key_env)
        self.cfg, self.settings = cfg, settings

    def run(self, jobs: list[ConversationJob], on_done: Callable[[ConversationJob], None]) -> None:
        """Each worker regenerates whole conversations (turns are sequential); rows are written by this thread."""

        def work(job: ConversationJob) -> ConversationJob:
            while not job.done:
                seed = row_seed(self.settings.seed, str(job.conversation["id"]), job.next_slot)
                generation = self.client.complete(job.pending_prompt(), wire_tools(job.conversation), seed)
                job.accept(generation, self.cfg.keep_original_on_empty)
            return job

        with concurrent.futures.ThreadPoolExecutor(max_workers=self.cfg.batch_size) as pool:
            futures = [pool.submit(work, job) for job in jobs]
            try:
                for future in concurrent.futures.as_completed(futures):
                    on_done(future.result())
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
