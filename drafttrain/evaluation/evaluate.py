"""``evaluate()``: measure a proposer on a prompt set against plain decoding, in one process.

For every question the method (speculative decoding) and the baseline (``plain_decode``, the same forward path
without a draft) run on the same rendered prompt, one after the other, and the order rotates from one question
to the next so that a slow phase of a shared machine hits both sides alike. One warm-up run of every side comes
first and is not counted. Wall times are taken here, around each ``generate`` call, with the same clock for
every side (prefill included; prompt rendering excluded).

Multi-turn questions (MT-Bench) follow EAGLE's eval: turn t is asked after the side's *own* answers to turns
< t. At T=0 a lossless engine produces the baseline's text, so both sides see the same history.

No generated text is logged or stored: records hold token counts, timings and acceptance counts only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import drafttrain
from drafttrain import DrafttrainError
from drafttrain.cpu_linear import PackedLinears
from drafttrain.evaluation import metrics
from drafttrain.evaluation.suites import Question, Suite
from drafttrain.data.chat import prompt_ids, stop_token_ids
from drafttrain.decoding import NoDraft, SpeculativeDecoder, StaticTree, build_proposer, plain_decode
from drafttrain.drafts import Drafter
from drafttrain.sampling import Sampling, check_sampling

log = logging.getLogger(__name__)

WARMUP_NEW_TOKENS = 16
CALIBRATION_NEW_TOKENS = 64  # per calibration prompt, for depth auto

# generate function of one side: rendered prompt ids (1, L) -> (new tokens, DecodeStats; for HF a dict of counts)
GenerateFn = Callable[[torch.Tensor], tuple[list[int], Any]]
COMPARE_PREFIX = "compare:"
# A draft that adapts its target (Medusa-2) is verified against the adapted target; this side decodes with the
# adapters off, so the report says how far the served target moved from the original and the speedup against it.
ORIGINAL_TARGET = "original_target"


@dataclasses.dataclass
class EvalReport:
    """Result of :func:`evaluate`. ``overall`` and each ``categories[name]`` are :func:`metrics.summarize` objects;
    ``prompts`` holds one record per question (counts and timings, never text); ``references`` holds the
    optional Hugging Face ``generate`` lines (their throughput, and speed relative to our baseline)."""

    config: dict[str, Any]
    overall: dict[str, Any]
    categories: dict[str, dict[str, Any]]
    prompts: list[dict[str, Any]]
    references: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # Other proposers run on the same prompts in the same process against the same baseline (``compare=``).
    comparisons: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # Only for a draft that adapts its target: plain decoding of the original target on the same prompts.
    original_target: dict[str, Any] | None = None

    @property
    def greedy_match(self) -> float | None:
        return self.overall.get("greedy_match")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)


@dataclasses.dataclass
class SideRun:
    """One side (method, baseline or an HF reference) on one question, all turns."""

    turn_tokens: list[list[int]]
    seconds: float
    stats: list[Any]  # per turn: DecodeStats, or {"target_forwards": n} for HF references
    prompt_tokens: list[int]

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.turn_tokens)


def evaluate(
    target,
    proposer: str | Any,  # a registered proposer name, a Proposer, or a trained Drafter
    prompts: Suite | Sequence[Question | str],
    *,
    depth: int | str = 5,
    tree: Any = "chain",
    min_confidence: float = 0.0,
    max_depth: int = 8,
    calibration: Sequence[Question] = (),
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 128,
    seed: int = 0,
    baseline: bool = True,
    hf_reference: bool = False,
    progress: bool = True,
    proposer_kwargs: dict[str, Any] | None = None,
    warmup: bool = True,
    compare: Sequence[str | Compared] = (),
    cpu_linear: str | None = None,
) -> EvalReport:
    """Run ``proposer`` (a registered name, or a proposer object) through :class:`SpeculativeDecoder` on every
    prompt, with ``plain_decode`` as the baseline, and return the metrics (see :mod:`metrics` for definitions).

    ``prompts``: a :class:`Suite` (already selected with ``Suite.select``), or questions, or plain strings (one
    single-turn question each, category "default"). ``hf_reference`` adds HF ``model.generate`` lines (greedy, and
    prompt lookup or assisted generation matching the proposer) to ``report.references``. ``compare`` names other
    registered proposers (that need no draft, e.g. ``prompt_lookup``) to run through the same engine settings on
    the same prompts, interleaved with the others, into ``report.comparisons``.

    ``depth="auto"`` (chains) chooses the depth and confidence threshold from this machine's measured costs and
    the draft's acceptance on the ``calibration`` questions (never the reported ones), up to ``max_depth``
    (drafttrain.decoding.autodepth); depth 0 means plain decoding. The choice is in ``report.config``.

    ``cpu_linear``: on a CPU every side runs its linear layers through oneDNN with pre-packed weights ("packed",
    the default) or PyTorch's own kernel ("default"); see drafttrain.cpu_linear.
    """
    auto = depth == "auto"
    _check_settings(max_depth if auto else depth, temperature, top_p, top_k, max_new_tokens)
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    suite_name, questions = _as_questions(prompts)
    with PackedLinears(target.model, mode=cpu_linear) as kernels:
        proposer_kwargs = dict(proposer_kwargs or {})
        if isinstance(proposer, Drafter):  # a trained draft: its kind says which proposer serves it
            proposer, proposer_kwargs = proposer.proposer, {**proposer_kwargs, "draft": proposer}
        proposer_name = proposer if isinstance(proposer, str) else getattr(proposer, "name", type(proposer).__name__)
        proposer_obj = build_proposer(proposer, target, **proposer_kwargs) if isinstance(proposer, str) else proposer
        kernels.add(*proposer_obj.modules())
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        proposer_obj, depth, tree, min_confidence, chosen = resolve_auto(
            target, proposer_obj, depth, tree, min_confidence, max_depth, calibration, sampling, seed, max_new_tokens)
        if (chosen.get("depth_auto") or {}).get("depth") == 0:
            proposer_name = f"{proposer_name} (depth auto: plain decoding)"
        if (chosen.get("tree_auto") or {}).get("plain_decoding"):
            proposer_name = f"{proposer_name} (tree auto: plain decoding)"
        decoder = SpeculativeDecoder(target, proposer_obj, depth=depth, tree=tree, min_confidence=min_confidence,
                                     seed=seed, **sampling)
        # The one stop rule (template end-of-turn + EOS), the same for every side, HF references included.
        stop_ids = stop_token_ids(target.tokenizer, target.model.generation_config)

        def speculative_fn(spec_decoder) -> Callable[[int], GenerateFn]:
            def make(budget: int) -> GenerateFn:
                def run(ids: torch.Tensor):
                    out = spec_decoder.generate(ids, budget, stop_token_ids=set(stop_ids))
                    return list(out.tokens), out.stats
                return run
            return make

        method_fn = speculative_fn(decoder)

        def baseline_fn(budget: int) -> GenerateFn:
            def run(ids: torch.Tensor):
                out = plain_decode(target, ids, budget, seed=seed, stop_token_ids=set(stop_ids), **sampling)
                return list(out.tokens), out.stats
            return run

        draft = proposer_kwargs.get("draft")
        sides: dict[str, Callable[[int], GenerateFn]] = {"method": method_fn}
        if baseline:
            sides["baseline"] = baseline_fn
            if isinstance(draft, Drafter) and draft.adapts_target:
                sides[ORIGINAL_TARGET] = _with_original_target(draft, baseline_fn)
        if hf_reference:
            sides.update(_hf_sides(target, proposer_obj, depth, stop_ids, **sampling))
        compared_config = []
        for item in compare:
            other = item if isinstance(item, Compared) else Compared(item)
            decoder_other, described = other.decoder(target, depth, tree, min_confidence, max_depth, calibration,
                                                     sampling, seed, max_new_tokens, kernels)
            if COMPARE_PREFIX + described["label"] in sides:  # one would silently replace the other
                raise DrafttrainError(f"two compared sides are both labelled {described['label']!r}: give them labels")
            sides[COMPARE_PREFIX + described["label"]] = speculative_fn(decoder_other)
            compared_config.append(described)

        if warmup:
            _warm_up(target.tokenizer, questions[0], sides, min(WARMUP_NEW_TOKENS, max_new_tokens), target.device)

        records = []
        extra_runs: dict[str, list[tuple[SideRun, SideRun | None]]] = {
            name: [] for name in sides if name.startswith(("hf_", COMPARE_PREFIX, ORIGINAL_TARGET))}
        for index, question in enumerate(_progress(questions, progress)):
            runs = _run_question_interleaved(
                target.tokenizer, question, sides, max_new_tokens, rotation=index, device=target.device
            )
            records.append(_prompt_record(question, runs, temperature))
            for name in extra_runs:
                extra_runs[name].append((runs[name], runs.get("baseline")))

        overall = metrics.summarize(records, depth)
        categories = {
            name: metrics.summarize([r for r in records if r["category"] == name], depth)
            for name in dict.fromkeys(r["category"] for r in records)  # first-seen order
        }
        config = _config(
            target, proposer_name, proposer_kwargs, depth, tree, temperature, top_p, top_k, max_new_tokens, seed,
            suite_name, questions, baseline, hf_reference, compared_config, started_at, stop_ids,
        )
        config["draft"] = draft.identity() if isinstance(draft, Drafter) else None  # which weights were measured
        config["min_confidence"] = min_confidence
        config["depth_auto"] = chosen.get("depth_auto")
        config["tree_auto"] = chosen.get("tree_auto")
        config["cpu_linear"] = {"mode": kernels.mode, "packed_layers": kernels.count}
        references = {name: _reference_line(pairs, temperature) for name, pairs in extra_runs.items()
                      if name.startswith("hf_")}
        comparisons = {name.removeprefix(COMPARE_PREFIX): _comparison_line(pairs, temperature)
                       for name, pairs in extra_runs.items() if name.startswith(COMPARE_PREFIX)}
        original = (_original_target_line(extra_runs[ORIGINAL_TARGET], records, temperature)
                    if ORIGINAL_TARGET in extra_runs else None)
        return EvalReport(config=config, overall=overall, categories=categories, prompts=records,
                          references=references, comparisons=comparisons, original_target=original)


@dataclasses.dataclass
class Compared:
    """Another side of the same run: a registered proposer name, a Proposer, or a trained Drafter, with its own
    depth and tree (None: the method's; "auto": chosen like the method's)."""

    proposer: str | Any
    depth: int | str | None = None
    tree: Any = None
    label: str | None = None

    def decoder(self, target, depth, tree, min_confidence, max_depth, calibration, sampling: dict, seed: int,
                max_new_tokens: int, kernels: PackedLinears | None = None) -> tuple[SpeculativeDecoder, dict[str, Any]]:
        proposer, kwargs = self.proposer, {}
        if isinstance(proposer, Drafter):
            if proposer.adapts_target:
                raise DrafttrainError(f"a {proposer.kind} draft that adapts its target cannot share a run with "
                                      "other drafts (it changes the target they are measured on): evaluate it alone")
            proposer, kwargs = proposer.proposer, {"draft": proposer}
        built = build_proposer(proposer, target, **kwargs) if isinstance(proposer, str) else proposer
        if kernels is not None:
            kernels.add(*built.modules())
        depth = depth if self.depth is None else self.depth
        tree = tree if self.tree is None else self.tree
        described = {"label": self.label or built.name, "proposer": built.name}
        built, depth, tree, min_confidence, chosen = resolve_auto(
            target, built, depth, tree, min_confidence, max_depth, calibration, sampling, seed, max_new_tokens)
        described.update(**chosen, depth=depth, tree=describe_tree(tree), min_confidence=min_confidence)
        return SpeculativeDecoder(target, built, depth=depth, tree=tree, min_confidence=min_confidence, seed=seed,
                                  **sampling), described


def resolve_auto(target, proposer, depth, tree, min_confidence: float, max_depth: int,
                 calibration: Sequence[Question], sampling: dict, seed: int, max_new_tokens: int):
    """Depth and tree "auto" chosen for ``proposer`` on the calibration prompts. Returns (proposer, depth, tree,
    min_confidence, the choices' summaries for the report); NoDraft when plain decoding wins."""
    chosen: dict[str, Any] = {}
    budget = min(max_new_tokens, CALIBRATION_NEW_TOKENS)
    if tree == "auto":  # a static tree sized for this draft and machine (proposers that fill static trees)
        choice = choose_tree(target, proposer, calibration, budget)
        tree, chosen["tree_auto"] = StaticTree(choice.paths), choice.summary()
        if choice.plain:  # the best tree still loses to plain decoding here
            proposer, depth, tree = NoDraft(), 1, "chain"
    if depth == "auto":
        choice = choose_depth(target, proposer, calibration, max_depth, Sampling(**sampling), budget, seed)
        depth, min_confidence, chosen["depth_auto"] = choice.depth, choice.min_confidence, choice.summary()
        if depth == 0:  # drafting would cost more than it saves: plain decoding
            proposer, depth = NoDraft(), 1
    return proposer, depth, tree, min_confidence, chosen


def choose_depth(target, proposer, calibration: Sequence[Question], max_depth: int, sampling: Sampling,
                 max_new_tokens: int, seed: int):
    """``depth="auto"``: measure costs on the first calibration prompt, acceptance on all of them, and choose."""
    from drafttrain.decoding.autodepth import calibrate, choose, measure_costs

    prompts, stops = _calibration_prompts(target, calibration)
    with torch.inference_mode():
        costs = measure_costs(target, proposer, prompts[0], max_depth)
    acceptance = calibrate(target, proposer, prompts, max_depth, max_new_tokens, stops, sampling, seed)
    choice = choose(costs, acceptance, max_depth)
    log.info("depth auto: depth %d, min_confidence %.1f, predicted speedup %.2fx (by depth: %s)", choice.depth,
             choice.min_confidence, choice.predicted_speedup,
             ", ".join(f"{d}: {s:.2f}" for d, s in choice.by_depth.items()))
    return choice


def choose_tree(target, proposer, calibration: Sequence[Question], max_new_tokens: int):
    """``tree="auto"``: trees built from the proposer's rank accuracies on the calibration prompts, costed here."""
    from drafttrain.decoding.autodepth import choose_tree as choose

    prompts, stops = _calibration_prompts(target, calibration)
    choice = choose(target, proposer, prompts, max_new_tokens, stops)
    log.info("tree auto: %d nodes, predicted speedup %.2fx (by size: %s)", len(choice.paths), choice.predicted_speedup,
             ", ".join(f"{n}: {s:.2f}" for n, s in choice.by_size.items()))
    return choice


def _calibration_prompts(target, calibration: Sequence[Question]) -> tuple[list[torch.Tensor], set[int]]:
    if not calibration:
        raise DrafttrainError("depth or tree auto needs calibration prompts (held out from the reported ones)")
    prompts = [torch.tensor([prompt_ids(target.tokenizer, [{"role": "user", "content": q.turns[0]}])],
                            device=target.device) for q in calibration]
    return prompts, set(stop_token_ids(target.tokenizer, target.model.generation_config))


def _check_settings(depth: int, temperature: float, top_p: float, top_k: int, max_new_tokens: int) -> None:
    """Before any decoding: a value that can only fail later must fail now."""
    check_sampling(temperature, top_p, top_k)
    if not isinstance(depth, int) or depth <= 0:
        raise DrafttrainError(f"depth (k) must be a positive integer, got {depth!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise DrafttrainError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")


def _as_questions(prompts: Suite | Sequence[Question | str]) -> tuple[str, list[Question]]:
    if isinstance(prompts, Suite):
        name, items = prompts.name, list(prompts.questions)
    else:
        name = "custom"
        items = [
            p if isinstance(p, Question) else Question(question_id=str(i), category="default", turns=(p,))
            for i, p in enumerate(prompts)
        ]
    if not items:
        raise DrafttrainError(f"empty prompt set ({name}): nothing to evaluate")
    return name, items


def _answer_text(tokenizer, tokens: list[int]) -> str:
    """The answer as the next turn's history sees it (stop and other special tokens dropped, as EAGLE's eval does)."""
    return tokenizer.decode(tokens, skip_special_tokens=True).strip()


def run_turns(tokenizer, question: Question, generate: GenerateFn, device: torch.device | None = None) -> SideRun:
    """Ask the question's turns in order, each after this side's own previous answers; time the generate calls.

    Prompts are rendered on the CPU and moved to ``device`` before the clock starts (HF's generate does not
    move them itself)."""
    history: list[dict[str, str]] = []
    turn_tokens, stats, prompt_tokens, seconds = [], [], [], 0.0
    for turn in question.turns:
        messages = history + [{"role": "user", "content": turn}]
        ids = torch.tensor([prompt_ids(tokenizer, messages)])
        if device is not None:
            ids = ids.to(device)
        _sync(ids.device)
        start = time.perf_counter()
        tokens, turn_stats = generate(ids)
        _sync(ids.device)
        seconds += time.perf_counter() - start
        turn_tokens.append(tokens)
        stats.append(turn_stats)
        prompt_tokens.append(int(ids.shape[-1]))
        history = messages + [{"role": "assistant", "content": _answer_text(tokenizer, tokens)}]
    return SideRun(turn_tokens=turn_tokens, seconds=seconds, stats=stats, prompt_tokens=prompt_tokens)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(
    tokenizer, question: Question, sides: dict[str, Callable[[int], GenerateFn]], budget: int, device: torch.device
) -> None:
    """One short, uncounted run of every side: first-call costs (allocations, kernel selection) stay out."""
    first_turn = dataclasses.replace(question, turns=question.turns[:1])
    for make in sides.values():
        run_turns(tokenizer, first_turn, make(budget), device)


def _run_question_interleaved(
    tokenizer, question: Question, sides: dict[str, Callable[[int], GenerateFn]], budget: int, rotation: int,
    device: torch.device,
) -> dict[str, SideRun]:
    """Run every side on the question; the starting side rotates with ``rotation`` (method, baseline alternate)."""
    names = list(sides)
    shift = rotation % len(names)
    order = names[shift:] + names[:shift]
    return {name: run_turns(tokenizer, question, sides[name](budget), device) for name in order}


def _progress(questions: list[Question], enabled: bool):
    if not enabled:
        return questions
    from tqdm.auto import tqdm

    return tqdm(questions, desc="eval", unit="prompt", leave=False)


def _stats_lists(stats: list[Any], field: str) -> list[int]:
    return [v for s in stats for v in getattr(s, field)]


def _sum_positions(stats: list[Any], field: str) -> list[int]:
    total: list[int] = []
    for s in stats:
        values = list(getattr(s, field, []) or [])
        total += [0] * (len(values) - len(total))
        for i, v in enumerate(values):
            total[i] += int(v)
    return total


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None when equal); a length difference counts at the shorter end."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _prompt_record(question: Question, runs: dict[str, SideRun], temperature: float) -> dict[str, Any]:
    method = runs["method"]
    stats = method.stats
    accepted = _stats_lists(stats, "accepted_per_step")
    drafted = _stats_lists(stats, "drafted_per_step")
    record: dict[str, Any] = {
        "question_id": question.question_id,
        "category": question.category,
        "turns": len(question.turns),
        "prompt_tokens": method.prompt_tokens,
        "new_tokens": method.new_tokens,
        "turn_new_tokens": [len(t) for t in method.turn_tokens],
        "wall_time_s": method.seconds,
        "tokens_per_s": metrics.tokens_per_s(method.new_tokens, method.seconds),
        "target_forwards": sum(int(s.target_forwards) for s in stats),
        "tau": metrics.tau(accepted),
        "acceptance_rate": metrics.acceptance_rate(accepted, drafted),
        "accepted_per_step": accepted,
        "drafted_per_step": drafted,
        # The engine's own per-depth counters, kept raw (the report derives per-position rates from the steps).
        "engine_position_drafted": _sum_positions(stats, "position_drafted"),
        "engine_position_accepted": _sum_positions(stats, "position_accepted"),
        "prefill_time_s": sum(float(s.prefill_time_s) for s in stats),
        "proposer_time_s": sum(float(s.proposer_time_s) for s in stats),
        "verify_time_s": sum(float(s.verify_time_s) for s in stats),
        "baseline_new_tokens": None,
        "baseline_wall_time_s": None,
        "baseline_tokens_per_s": None,
        "speedup": None,
        "greedy_match": None,
        "first_mismatch": None,
    }
    base = runs.get("baseline")
    if base is not None:
        record.update(
            baseline_new_tokens=base.new_tokens,
            baseline_turn_new_tokens=[len(t) for t in base.turn_tokens],
            baseline_wall_time_s=base.seconds,
            baseline_tokens_per_s=metrics.tokens_per_s(base.new_tokens, base.seconds),
            speedup=metrics.speedup([method.new_tokens], [method.seconds], [base.new_tokens], [base.seconds]),
        )
        if temperature == 0:
            mismatches = [_first_mismatch(m, b) for m, b in zip(method.turn_tokens, base.turn_tokens)]
            record["greedy_match"] = all(m is None for m in mismatches)
            # Where each turn first diverged (token index), to debug losslessness without storing text.
            record["first_mismatch"] = mismatches
    return record


# ---------------------------------------------------------------- Hugging Face reference lines


def _hf_sides(target, proposer_obj, depth, stop_ids, **sampling):
    """HF ``generate`` runners: greedy/sampled plain decoding, plus HF's own version of the proposer if it has one."""
    sides: dict[str, Callable[[int], GenerateFn]] = {"hf_generate": lambda n: _hf_generate_fn(target, n, stop_ids, sampling)}
    equivalent = proposer_obj.hf_equivalent(depth)
    if equivalent is None:
        return sides
    name, extra = equivalent
    if "assistant_model" not in extra:
        sides[name] = lambda n: _hf_generate_fn(target, n, stop_ids, sampling, extra)
        return sides
    if depth:  # HF at our draft length, constant; depth 0 is plain decoding, which HF cannot be pinned to
        sides[name] = lambda n: _hf_generate_fn(target, n, stop_ids, sampling, extra, assistant_k=depth)
    # ... and as a new user gets it: HF's own schedule (the draft length adapts) and confidence stop
    sides[name + "_default"] = lambda n: _hf_generate_fn(target, n, stop_ids, sampling, extra)
    return sides


@contextlib.contextmanager
def _constant_assistant(assistant: torch.nn.Module, k: int):
    """HF reads the draft length from the *assistant's* generation_config (generate kwargs are ignored there),
    and its default schedule grows k between calls and stops drafting below a confidence threshold. Pin it to
    a constant k, as our engine drafts, for the duration of one call; the model's own config is restored."""
    original = assistant.generation_config
    pinned = copy.deepcopy(original)
    pinned.num_assistant_tokens = k
    pinned.num_assistant_tokens_schedule = "constant"
    pinned.assistant_confidence_threshold = 0.0
    assistant.generation_config = pinned
    try:
        yield
    finally:
        assistant.generation_config = original


def _hf_generate_fn(
    target, budget: int, stop_ids, sampling: dict, extra: dict | None = None, assistant_k: int | None = None
) -> GenerateFn:
    model = target.model
    do_sample = sampling["temperature"] > 0
    kwargs: dict[str, Any] = dict(
        max_new_tokens=budget,
        do_sample=do_sample,
        eos_token_id=list(stop_ids),
        pad_token_id=stop_ids[0] if stop_ids else None,
        # Neutralise any sampling defaults from the model's generation_config.
        temperature=sampling["temperature"] if do_sample else None,
        top_p=sampling["top_p"] if do_sample else None,
        top_k=(sampling["top_k"] or None) if do_sample else None,
        **(extra or {}),
    )

    def run(ids: torch.Tensor):
        forwards = [0]
        # Count the target's forwards (HF exposes no acceptance counts) to estimate HF's tokens per step.
        handle = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        pinned = (
            _constant_assistant(kwargs["assistant_model"], assistant_k)
            if assistant_k is not None else contextlib.nullcontext()
        )
        try:
            with torch.inference_mode(), pinned:
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        finally:
            handle.remove()
        return out[0, ids.shape[-1]:].tolist(), {"target_forwards": forwards[0]}

    return run


def _hf_tau_estimate(runs: list[SideRun]) -> float | None:
    """Σ new tokens / Σ target forwards. Every HF forward emits accepted + 1 tokens: plain decoding's prefill
    emits the first token, and assisted / prompt-lookup decoding verifies its first draft inside the prefill
    forward. So this is τ's counterpart (up to a truncated last step); plain decoding gives exactly 1."""
    tokens = sum(len(t) for run in runs for t in run.turn_tokens)
    forwards = sum(stats["target_forwards"] for run in runs for stats in run.stats)
    return tokens / forwards if forwards else None


def _reference_line(pairs: list[tuple[SideRun, SideRun | None]], temperature: float) -> dict[str, Any]:
    return dict(_speed_line(pairs, temperature), tau_estimate=_hf_tau_estimate([r for r, _ in pairs]))


def _speed_line(pairs: list[tuple[SideRun, SideRun | None]], temperature: float) -> dict[str, Any]:
    """Throughput of one extra side, its speed against the baseline on the same prompts, and greedy agreement."""
    tokens = sum(r.new_tokens for r, _ in pairs)
    seconds = sum(r.seconds for r, _ in pairs)
    line = {
        "tokens_per_s": metrics.tokens_per_s(tokens, seconds),
        "new_tokens": tokens,
        "wall_time_s": seconds,
        "speed_vs_baseline": None,
        "greedy_match_vs_baseline": None,
    }
    bases = [b for _, b in pairs if b is not None]
    if len(bases) == len(pairs) and pairs:
        line["speed_vs_baseline"] = metrics.speedup(
            [r.new_tokens for r, _ in pairs], [r.seconds for r, _ in pairs],
            [b.new_tokens for b in bases], [b.seconds for b in bases],
        )
        if temperature == 0:
            line["greedy_match_vs_baseline"] = metrics.greedy_match_share(
                [r.turn_tokens == b.turn_tokens for r, b in pairs]
            )
    return line


def _with_original_target(draft, make_baseline: Callable[[int], GenerateFn]) -> Callable[[int], GenerateFn]:
    def make(budget: int) -> GenerateFn:
        run = make_baseline(budget)

        def run_original(ids: torch.Tensor):
            with draft.original_target():
                return run(ids)
        return run_original
    return make


def _original_target_line(pairs: list[tuple[SideRun, SideRun | None]], records: list[dict[str, Any]],
                          temperature: float) -> dict[str, Any]:
    """The original target's plain decoding against the adapted one (greedy agreement: how far the target moved)
    and the method's speedup against it (what a user who swaps the original for adapted target + heads gets)."""
    line = _speed_line(pairs, temperature)
    line["method_speedup_vs_original"] = metrics.speedup(
        [r["new_tokens"] for r in records], [r["wall_time_s"] for r in records],
        [r.new_tokens for r, _ in pairs], [r.seconds for r, _ in pairs])
    return line


def _comparison_line(pairs: list[tuple[SideRun, SideRun | None]], temperature: float) -> dict[str, Any]:
    """A speed line with the engine's own τ and acceptance."""
    line = _speed_line(pairs, temperature)
    stats = [s for run, _ in pairs for s in run.stats]
    accepted, drafted = _stats_lists(stats, "accepted_per_step"), _stats_lists(stats, "drafted_per_step")
    return dict(line, tau=metrics.tau(accepted), acceptance_rate=metrics.acceptance_rate(accepted, drafted))


# ---------------------------------------------------------------- run description


def describe_tree(tree: Any) -> Any:
    if isinstance(tree, str):
        return tree
    if hasattr(tree, "paths"):  # a StaticTree object
        return {"kind": "static", "paths": [list(p) for p in tree.paths]}
    if dataclasses.is_dataclass(tree):
        return {"kind": type(tree).__name__, **dataclasses.asdict(tree)}
    if isinstance(tree, (list, tuple)):
        return {"kind": "static", "paths": [list(p) for p in tree]}
    return repr(tree)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    name = getattr(value, "name", None)  # a Target: its spec
    return name if isinstance(name, str) else type(value).__name__


def machine_description() -> dict[str, Any]:
    """Enough to compare runs, nothing that identifies the host (no hostname, no user)."""
    return {
        "platform": platform.platform(terse=True),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _config(target, proposer_name, proposer_kwargs, depth, tree, temperature, top_p, top_k, max_new_tokens, seed,
            suite_name, questions, baseline, hf_reference, compare, started_at, stop_ids) -> dict[str, Any]:
    import transformers

    param = next(target.model.parameters())
    return {
        "target": target.name,
        "proposer": proposer_name,
        "proposer_kwargs": _jsonable(proposer_kwargs),
        "depth": depth,
        "tree": describe_tree(tree),
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "stop_token_ids": list(stop_ids),
        "suite": suite_name,
        "num_prompts": len(questions),
        "num_turns": sum(len(q.turns) for q in questions),
        "baseline": "plain_decode" if baseline else None,
        "hf_reference": hf_reference,
        "compare": list(compare),  # one description per compared side (label, proposer, draft, depth, tree)
        "dtype": str(param.dtype).removeprefix("torch."),
        "device": str(param.device),
        "threads": torch.get_num_threads(),
        "versions": {"drafttrain": drafttrain.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "machine": machine_description(),
        "timing": "wall clock around each generate call, prefill included; method and baseline interleaved",
        "started_at": started_at,
    }
