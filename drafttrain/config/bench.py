"""``drafttrain bench``'s section: how the serving engine is driven."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from drafttrain.config.base import Section, positive_int, setting_error


class BenchConfig(Section):
    """``drafttrain bench``: how the engine is driven, level by level (the flags fill this schema)."""

    engine: Literal["vllm", "sglang"] = "vllm"
    concurrency: list[int] = [1, 2, 4, 8, 16, 32]
    # draft lengths the engine is served with (one server each); the report says which pays at each level
    num_speculative_tokens: list[int] = [3]
    # requests per level: at least this many, and at least ``requests_per_stream`` per concurrent stream, so every
    # level runs long enough to leave its ramp-up behind
    min_requests: int = 8
    requests_per_stream: int = 2
    output_len: int = 128
    temperature: float = Field(0.0, ge=0)
    num_prompts: int | None = None  # how many of the suite's questions to take (None: every one)
    # τ by the engine and by our evaluator at concurrency 1, T=0: the tolerance of their difference (vLLM and our
    # proposer both draft by argmax, so only a near-tie flipped by different kernels separates them)
    agreement_tolerance: float = Field(0.03, ge=0)
    # a draft "pays" at a level only when its output tokens/s beat plain serving's by more than this share (and by
    # more than plain serving's own spread between passes, when there are several): a side that never drafts can
    # measure several percent above plain serving
    pays_margin: float = Field(0.03, ge=0)
    # the share of the machine's (or GPU's) memory all servers of one bench together may hold
    memory_fraction: float = Field(0.8, gt=0, le=1)
    port: int = Field(8100, gt=0, lt=65536)
    # float32 by default, as drafttrain's evaluator computes, so the one-stream agreement check compares like with
    # like; a GPU user serving bfloat16 says so here
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    server_args: list[str] = []  # passed to every server as they are (--enforce-eager, --max-model-len 4096, ...)
    startup_timeout_s: float = Field(900.0, gt=0)
    repeats: int = 1  # passes over the levels; sides alternate their order pass by pass and level by level

    @field_validator("concurrency", "num_speculative_tokens")
    @classmethod
    def _positive_levels(cls, value: list[int]) -> list[int]:
        if not value:
            raise setting_error("must name at least one value")
        return sorted({positive_int(v) for v in value})

    @field_validator("min_requests", "requests_per_stream", "output_len", "repeats")
    @classmethod
    def _positive(cls, value: Any) -> int:
        return positive_int(value)

    @field_validator("num_prompts", mode="before")
    @classmethod
    def _num_prompts(cls, value: Any) -> Any:
        return None if value is None else positive_int(value)

    def requests_at(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_stream * concurrency)
