"""Where the training conversations come from, and how the target re-answers them."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from drafttrain.config.base import Section


class SourceConfig(Section):
    path: str  # local file (json/jsonl/parquet, optionally .gz) or a Hub dataset id
    # request_log: served traffic (OpenAI-format request/response logs); prompts: a prompts file (data/traffic.py)
    format: Literal["auto", "sharegpt", "openai", "alpaca", "fastchat", "gsm8k", "mbpp", "self_instruct",
                    "request_log", "prompts"] = "auto"
    split: str = "train"  # Hub datasets only
    subset: str | None = None  # Hub dataset config name
    weight: float = Field(1.0, gt=0)  # share of data.num_samples, relative to the other sources
    max_samples: int | None = Field(None, gt=0)  # hard cap on rows taken from this source
    # None: follow regenerate.enabled. False: keep this source's own answers, so a large written corpus can be mixed
    # with a smaller share the target re-answers (regeneration is the slow stage on small machines).
    regenerate: bool | None = None
    # A request log written by `drafttrain eval --feedback` (the closed loop): the loss weight of each answer token
    # the target put in place of draft tokens it refused, where the draft most needs to learn (1: no weighting)
    rejected_weight: int = Field(1, ge=1, le=100)

    @model_validator(mode="after")
    def _weights_from_a_log(self) -> "SourceConfig":
        if self.rejected_weight != 1 and self.format != "request_log":
            raise ValueError(f"rejected_weight is for a request log written by `drafttrain eval --feedback` "
                             f"(format: request_log), not format {self.format!r}")
        return self


class ReplayConfig(Section):
    """Rows of an earlier run's train split mixed into this one, so a draft adapted to new data (draft.init_from)
    keeps what it learnt there: the same tokenizer, taken as they were tokenised (nothing is re-answered)."""

    run: str  # the earlier run's output_dir (its data/train split and manifest)
    fraction: float = Field(gt=0, lt=1)  # the replayed rows' share of the final train split


class DataConfig(Section):
    sources: list[SourceConfig] = Field(min_length=1)  # the sources mixed by weight
    num_samples: int | None = Field(None, gt=0)  # total conversations after mixing; None = all
    dedupe: bool = True  # drop a conversation that occurs twice in the pool
    validation_fraction: float = Field(0.05, ge=0, lt=1)  # held out: chooses checkpoints by real τ
    max_length: int = Field(2048, gt=8)  # tokens per row; longer rows are cut
    # Conversations longer than max_length are cut (keeping what fits) or dropped (counted in the summary).
    overlength: Literal["truncate", "drop"] = "truncate"
    packing: bool = False  # pack several conversations per row (document-aware position ids)
    cache_dir: str | None = None  # default: <output_dir>/cache
    replay: ReplayConfig | None = None  # rows of an earlier run mixed back in (continuing a draft)


class RegenerateConfig(Section):
    enabled: bool = True  # the target answers every conversation again (its own distribution)
    backend: Literal["hf", "openai"] = "hf"  # hf: in this process; openai: a vLLM or SGLang server
    base_url: str | None = None  # OpenAI-compatible server (vLLM / SGLang), backend=openai
    api_key_env: str = "OPENAI_API_KEY"  # the key is read from this variable, never from the recipe
    served_model: str | None = None  # model name on the server; default: target.model
    temperature: float = Field(0.0, ge=0)  # 0: greedy answers
    top_p: float = Field(1.0, gt=0, le=1)  # nucleus sampling of the answers
    max_new_tokens: int = Field(256, gt=0)  # the longest answer
    batch_size: int = Field(8, gt=0)  # conversations answered together
    # hf backend: a batch also holds at most this many tokens, rows x (its longest prompt + max_new_tokens), what its
    # KV cache holds: long prompts then share smaller batches instead of running out of memory. None: no limit.
    max_batch_tokens: int | None = Field(None, gt=0)
    # Keep the dataset's response when the target's answer is empty (counted), instead of dropping the row.
    keep_original_on_empty: bool = False
    # Reuse answers the same target gave with the same settings in earlier runs (the answer store in the cache).
    reuse_answers: bool = True

    @model_validator(mode="after")
    def _server_named(self) -> "RegenerateConfig":
        if self.backend == "openai" and not self.base_url:
            raise ValueError("base_url is required when backend is 'openai' (the server, e.g. "
                             "http://localhost:8000/v1)")
        if self.base_url is not None and not re.match(r"https?://[^/\s]+", self.base_url):
            raise ValueError(f"base_url {self.base_url!r} is not an http(s) URL")
        return self
