"""How speculative decoding runs (``drafttrain eval`` and a recipe's eval section)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from drafttrain import DrafttrainError
from drafttrain.config.base import Section, positive_int, setting_error
from drafttrain.config.errors import describe_errors
from drafttrain.sampling import check_sampling


class DecodeSettings(Section):
    """How speculative decoding runs, built and validated once: from a recipe's eval section or from the flags of
    ``drafttrain eval`` (which fill this schema), or with :meth:`of` by a library caller. The engine, the auto
    choice and ``evaluate()`` take it as it is."""

    # inf / nan reach check_sampling, whose message names the rule; tree shapes from library callers are objects
    model_config = ConfigDict(extra="forbid", validate_assignment=True, arbitrary_types_allowed=True,
                              allow_inf_nan=True)

    # The descriptions are the help of `drafttrain eval`'s flags (generated from these fields) and the recipe
    # reference's text alike.
    depth: int | Literal["auto"] = Field(5, description=(
        'chain length / tree depth; "auto" chooses the chain depth and a confidence threshold from this machine\'s '
        "measured costs and the draft's acceptance on held-out prompts (drafttrain.decoding.autodepth)"))
    max_depth: int = Field(8, description='the deepest chain "auto" considers')
    min_confidence: float = Field(0.0, description="stop a chain once the draft is this unsure (0: never)")
    tree: Any = Field("chain", description=(
        "chain | dynamic (EAGLE-2) | auto | a named static tree (medusa-16, ...) | a .json file of paths | "
        "static:PATHS; library callers may also give a list of paths or a shape object (drafttrain.decoding.trees)"))
    total_tokens: int = Field(60, description="dynamic tree: nodes verified per step")
    tree_top_k: int = Field(10, description="dynamic tree: children expanded per node")
    temperature: float = Field(0.0, description=(
        "0: greedy (lossless token for token); above: sampling (Leviathan/Chen)"))
    top_p: float = Field(1.0, description="sampling's nucleus")
    top_k: int = Field(0, description="sampling's top-k (0: off)")
    seed: int = Field(0, description="sampling's seed per prompt")
    max_new_tokens: int = Field(64, description="per turn")
    runtime_check: bool = Field(True, description=(
        "an auto choice that speculates is checked while decoding and falls back (to a shallower chain, or plain "
        "decoding) when it does not pay on this machine now (drafttrain.decoding.guard); a fixed depth is never "
        "changed"))

    @field_validator("depth", mode="before")
    @classmethod
    def _depth(cls, value: Any) -> Any:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise setting_error(f"(k) must be positive, or 'auto'; got {value!r}")
        return value

    _positive = field_validator("max_depth", "total_tokens", "tree_top_k", "max_new_tokens", mode="before")(
        classmethod(lambda cls, value: positive_int(value)))

    @field_validator("min_confidence")
    @classmethod
    def _confidence(cls, value: float) -> float:
        if not 0 <= value < 1:
            raise setting_error(f"must be in [0, 1), got {value!r}")
        return value

    @field_validator("tree")
    @classmethod
    def _tree(cls, value: Any) -> Any:
        if not isinstance(value, (str, list, tuple)) and not hasattr(value, "depth"):
            raise setting_error(f"must be a tree spec (chain, dynamic, auto, medusa-16, ...), a list of paths or a "
                                 f"tree shape, got {value!r}")
        return value

    @model_validator(mode="after")
    def _coherent(self) -> "DecodeSettings":
        try:
            check_sampling(self.temperature, self.top_p, self.top_k)
        except DrafttrainError as err:
            raise setting_error(str(err)) from None
        if self.depth == "auto" and self.tree != "chain":
            raise setting_error("depth auto chooses chain depths: use tree chain (the default), or give a depth")
        return self

    @property
    def deepest(self) -> int:
        """The deepest chain these settings may draft: the depth, or under "auto" the deepest it considers."""
        return self.max_depth if self.depth == "auto" else self.depth

    @property
    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    @classmethod
    def of(cls, settings: "DecodeSettings | None" = None, /, **changes: Any) -> "DecodeSettings":
        """``settings`` (or the defaults) with ``changes``, validated; a bad value is a DrafttrainError naming it."""
        values = {name: getattr(settings, name) for name in cls.model_fields} if settings is not None else {}
        try:
            return cls.model_validate({**values, **changes})
        except ValidationError as err:
            raise DrafttrainError(describe_errors(err, lambda loc: ".".join(map(str, loc)))) from None

    def fitted_to(self, deepest: int | None) -> "DecodeSettings":
        """These settings with a default depth, or the default deepest depth "auto" considers, lowered to what the
        draft can fill (``deepest``; None: any). A depth the user gave is kept as it is (and refused, naming both,
        when it is deeper)."""
        if deepest is None:
            return self
        if self.depth == "auto":
            if "max_depth" in self.model_fields_set or self.max_depth <= deepest:
                return self
            return type(self).of(self, max_depth=deepest)  # a DFlash block of 8 fills 7, under auto's default 8
        if "depth" in self.model_fields_set or self.depth <= deepest:
            return self
        return type(self).of(self, depth=deepest)

    def decode_settings(self) -> "DecodeSettings":
        """Only the decode settings (a subclass's other fields left out)."""
        return DecodeSettings.of(self)


class LookaheadSettings(Section):
    """Lookahead decoding's shape (Fu et al., 2024; drafttrain.decoding.lookahead): the target guesses the next
    tokens itself by Jacobi iteration over a window, and verifies n-grams those guesses formed. ``drafttrain eval``
    generates its flags from these fields; a recipe has no such section (no draft is trained)."""

    # The descriptions are the help of the flags.
    lookahead_window: int = Field(5, description=(
        "lookahead: W, the future positions its Jacobi window guesses at each step"))
    lookahead_ngram: int = Field(4, description=(
        "lookahead: N, the n-gram size: the window keeps N-1 levels of guesses and the candidates verified are N-1 "
        "tokens after the last one emitted"))
    lookahead_pool: int = Field(5, description=(
        "lookahead: G, the n-grams kept per first token, all verified (as one tree) when that token is the last "
        "emitted"))

    _positive = field_validator("lookahead_window", "lookahead_pool", mode="before")(
        classmethod(lambda cls, value: positive_int(value)))

    @field_validator("lookahead_ngram", mode="before")
    @classmethod
    def _ngram(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int) or value < 3:
            raise setting_error(f"must be at least 3 (a window needs a level beyond its first), got {value!r}")
        return value

    @classmethod
    def of(cls, settings: "LookaheadSettings | None" = None, /, **changes: Any) -> "LookaheadSettings":
        """``settings`` (or the defaults) with ``changes``, validated; a bad value is a DrafttrainError naming it."""
        values = settings.model_dump() if settings is not None else {}
        try:
            return cls.model_validate({**values, **changes})
        except ValidationError as err:
            raise DrafttrainError(describe_errors(err, lambda loc: ".".join(map(str, loc)))) from None


class EngineEvalSettings(Section):
    """How the serving engine measures checkpoints (``eval.engine: vllm``) and serves the consistency gate
    (``eval.gate``): where it runs, its parallelism (vLLM's own flags, as the capture section's), what it computes in,
    and what it is sent. The engine runs from its own Python, never as a drafttrain dependency."""

    # a Python with vLLM installed (its own venv); None: $DRAFTTRAIN_VLLM_PYTHON
    python: str | None = None
    # true: `drafttrain train` measures each checkpoint as it is saved (training waits, the engine starts and stops
    # on this node's GPUs beside training); false: `drafttrain watch RECIPE` measures them, on other GPUs or nodes
    inline: bool = True
    tensor_parallel_size: int = Field(1, gt=0)  # vLLM's --tensor-parallel-size
    pipeline_parallel_size: int = Field(1, gt=0)  # vLLM's --pipeline-parallel-size
    data_parallel_size: int = Field(1, gt=0)  # vLLM's --data-parallel-size
    expert_parallel: bool = False  # vLLM's --enable-expert-parallel (MoE targets)
    # the dtype the engine computes in; auto: the recipe's target.dtype (float32 on a CPU, as drafttrain's evaluator,
    # so the agreement of the two compares like with like)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # the share of each GPU's memory (on a CPU: of RAM, for KV cache) its two servers, the target plain and with the
    # draft, take together
    memory_fraction: float = Field(0.2, gt=0, le=1)
    port: int = Field(8300, gt=0, lt=65535)  # the plain server's port; the draft's server takes the next one
    server_args: list[str] = []  # passed to both servers as they are (--enforce-eager, --max-model-len 4096, ...)
    startup_timeout_s: float = Field(1800.0, gt=0)  # a large target loads for minutes
    # held-out prompts sent one at a time (the first turns of data/validation_prompts.jsonl, never eval.suite's)
    num_prompts: int = Field(8, gt=0)
    max_new_tokens: int = Field(128, gt=0)  # per prompt
    # draft tokens per step the engine is served with (a chain); None: eval.depth, fitted to the draft
    num_speculative_tokens: int | None = Field(None, gt=0)
    # the export format the engine serves (one of the draft kind's codecs); None: the first format the draft is
    # written in that the engine reads
    format: str | None = None
    # the engine's τ and drafttrain's evaluator's on the same prompts may differ by this much (a near-tie broken the
    # other way by the engine's kernels); beyond it the checkpoint's record names the disagreement
    agreement_tolerance: float = Field(0.03, ge=0)
    gate_steps: int = Field(40, gt=0)  # the gate: optimizer steps overfitting the draft on its one row
    gate_learning_rate: float = Field(3e-3, gt=0)  # the gate's optimizer's learning rate (AdamW)
    gate_max_new_tokens: int = Field(48, gt=0)  # the gate row's answer: the plain server's greedy continuation
    # the gate stops the run when the engine's accepted tokens per step on the row differ from what the overfit
    # head predicts by more than this share of the prediction
    gate_tolerance: float = Field(0.3, gt=0, lt=1)

    @property
    def parallel_gpus(self) -> int:
        """GPUs one server takes."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


class EvalConfig(DecodeSettings):
    """The recipe's eval section: the prompts, and how to decode them."""

    suite: str = Field("mt_bench", description="the prompts reported on: a built-in suite or a FastChat .jsonl")
    num_prompts: int | None = Field(8, description=(
        "how many questions are reported on, taken one category at a time in turn (each category's in file order, "
        "so a few cover every category); None: every question of the suite"))

    @field_validator("num_prompts", mode="before")
    @classmethod
    def _num_prompts(cls, value: Any) -> Any:
        return None if value is None else positive_int(value)

    every_checkpoint: bool = True  # measure τ and speedup on held-out prompts at every checkpoint
    # a checkpoint evaluation during training starts no new prompt after this many minutes, and says it ran over
    # (on a busy machine a few prompts can take much longer than the training between checkpoints); None: no budget
    checkpoint_budget_minutes: float | None = Field(5.0, gt=0)
    # the serving engine that measures every checkpoint's acceptance (exported through its kind's codec, served
    # beside the target on held-out prompts, against plain serving); none: drafttrain's own evaluator alone
    # (every_checkpoint). Where the target is not whole in the training process (ZeRO-3, capture engines) only the
    # engine measures real acceptance
    engine: Literal["none", "vllm"] = "none"
    # how the engine runs and what it is sent, for eval.engine and the gate
    engine_settings: EngineEvalSettings = EngineEvalSettings()
    # before training, overfit the draft on one row, serve it in the engine and stop the run when the engine's
    # acceptance on that row is not what the head predicts (`drafttrain train --gate` sets it)
    gate: bool = False
