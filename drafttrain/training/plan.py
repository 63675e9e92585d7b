"""What a recipe will need, read from config files alone: memory per process by part, the offline cache on disk,
and the regeneration work. ``drafttrain plan`` prints it; ``train`` and ``prepare`` check it before any work and
refuse when the run clearly cannot fit.

Nothing is downloaded but config.json. The target and the draft are built on the ``meta`` device (shapes, no
storage), so parameter counts are exact for any architecture and any draft kind; the draft's own training step is
measured there too (footprint.py). The machine the run goes to is a :class:`~drafttrain.training.cluster.Cluster`,
and the capture servers a stream or an offline cache needs are planned in capture_plan.py.

Per process, on the device the recipe trains on:

* runtime: on CPU, this process's own resident memory after importing what training imports (measured); on a GPU,
  the CUDA context and allocator reserve (an estimate, :data:`~drafttrain.training.sizes.CUDA_CONTEXT`);
* the target's weights, split over the processes under ZeRO-3; when capture engines run the target
  (``capture.engine: vllm``), its head alone, as targets/partial.py loads it (everything outside the decoder layers,
  and the last layers a fresh draft starts from);
* the draft's weights, gradients and AdamW states, split as the ZeRO stage splits them;
* DeepSpeed's gradient-reduction buckets, which it allocates at their configured size however small the draft;
* activations saved for the backward pass, the target outputs the step consumes, and the largest transient: one
  chunk of full-vocabulary logits, the backward's working copy of the largest saved tensor, or what the forward
  holds beside its saved tensors at its peak (every storage alive at once in the meta run is counted).

For ``prepare``: the target's weights, its forward over the widest batch (an offline cache's training batch, or a
regeneration batch; measured on the meta device as the model's own code runs it, footprint.target_forward_bytes)
and, when the hf backend regenerates in this process, that batch's KV cache and, on a CPU, the
packed copies of the target's linear weights it generates through. Not counted: what the allocator keeps resident
beside the tensors alive. On a CPU, glibc keeps freed blocks of up to 32 MiB in its heap (one measured prefill: 1.6x
its tensors; docs/studies/scale_out.md), and resident memory grows by about 1 GiB while a batch of 7k-token rows
decodes its 256 tokens (its KV cache grows by 47 MiB), which puts the measured peak of long-row regeneration a fifth
above the plan (BENCHMARKS.md, "Regenerating the long rows in memory the plan counts").

The verdict: the run fits when every part fits (memory, the offline cache's disk, the capture side); it clearly
cannot fit, and ``train`` and ``prepare`` refuse it, when even :data:`~drafttrain.training.sizes.SLACK` of a need
exceeds what is there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import psutil
import torch
from transformers import AutoConfig, AutoModelForCausalLM

# A training process has imported the trainer before it loads anything: the runtime the plan measures includes it.
import drafttrain.training.trainer  # noqa: F401
from drafttrain import DrafttrainError
from drafttrain.config import Recipe
from drafttrain.cpu_linear import packed_weight_bytes
from drafttrain.drafts.continuation import ResolvedDraft, kept_target_layers, resolve_draft, run_target_needs
from drafttrain.runfolder import RunFolder, open_dataset
from drafttrain.sources.cache import cache_dtype, keeps_argmax
from drafttrain.sources.choose import capture_folder, engine_runs_target
from drafttrain.targets.checks import check_source
from drafttrain.targets.hidden import decoder_layers
from drafttrain.targets.loading import _DTYPES, Target, resolve_model_dir
from drafttrain.targets.outputs import TargetNeeds
from drafttrain.training.capture_plan import CapturePlan, capture_plan, server_weights
from drafttrain.training.cluster import Cluster, this_machine
from drafttrain.training.footprint import (
    _nbytes,
    draft_footprint,
    gradient_bucket_bytes,
    optimizer_bytes,
    target_forward_bytes,
)
from drafttrain.training.runtime import configured_zero_stage
from drafttrain.training.sizes import CUDA_CONTEXT, _cache_bytes, _on_gpu, _size, clearly_exceeds, within

log = logging.getLogger(__name__)

SKIP_ENV = "DRAFTTRAIN_SKIP_PLAN"


@dataclasses.dataclass
class Plan:
    """Per-process memory by part (bytes), the offline cache, the regeneration work, and the verdict."""
    stage: str  # "train" or "prepare"
    where: str  # e.g. "16 x GPU (80 GiB), ZeRO-3" or "1 x CPU process"
    memory: dict[str, int]
    capacity: int | None  # bytes available to one process (None: unknown)
    cache_bytes: int | None = None
    disk_free: int | None = None
    tokens: int = 0
    tokens_measured: bool = False  # from the prepared data, not estimated from the recipe
    regen_tokens: int = 0
    regen_seconds: float | None = None
    capture: CapturePlan | None = None  # the capture servers, when capture engines run the target
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.memory.values())

    @property
    def memory_fits(self) -> bool:
        return within(self.total, self.capacity)

    @property
    def disk_fits(self) -> bool:
        return within(self.cache_bytes, self.disk_free)

    @property
    def fits(self) -> bool:
        return self.memory_fits and self.disk_fits and (self.capture is None or self.capture.fits)

    @property
    def clearly_cannot_fit(self) -> bool:
        window = self.capture is not None and self.capture.window_clearly_too_big
        return clearly_exceeds(self.total, self.capacity) or window or clearly_exceeds(self.cache_bytes, self.disk_free)

    def render(self) -> str:
        lines = [f"drafttrain plan ({self.stage}): {self.where}", "", "memory per process:"]
        lines += [f"  {name:<34} {_size(value):>10}" for name, value in self.memory.items()]
        verdict = "fits" if self.memory_fits else "DOES NOT FIT"
        available = "unknown" if self.capacity is None else _size(self.capacity)
        lines.append(f"  {'total':<34} {_size(self.total):>10}   available {available}: {verdict}")
        lines.append("")
        if self.tokens_measured:
            lines.append(f"training tokens: {self.tokens:,} (counted in the prepared data)")
        elif self.tokens:
            lines.append(f"training tokens: about {self.tokens:,} (data.num_samples rows of half data.max_length)")
        else:
            lines.append("training tokens: unknown until prepare (data.num_samples is not set)")
        if self.cache_bytes is not None:
            free = "unknown" if self.disk_free is None else _size(self.disk_free)
            lines.append(f"offline cache: {_size(self.cache_bytes)} on disk, {free} free: "
                         f"{'fits' if self.disk_fits else 'DOES NOT FIT'}")
        if self.regen_tokens:
            at = (f", about {self.regen_seconds / 3600:.1f} h at the stated throughput"
                  if self.regen_seconds is not None else " (give --regen-throughput for a time)")
            lines.append(f"regeneration: at most {self.regen_tokens:,} new tokens{at}")
        if self.capture is not None:
            lines += ["", *self.capture.render()]
        lines += [f"note: {n}" for n in self.notes + (self.capture.notes if self.capture else [])]
        lines.append(f"verdict: {'fits' if self.fits else 'does not fit'}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        out = {**dataclasses.asdict(self), "total": self.total, "fits": self.fits}
        if self.capture is not None:
            out["capture"].update(self.capture.verdicts())
        return out


# ------------------------------------------------------------------------------------------------ a process's memory


def _capacity(recipe: Recipe, cluster: Cluster) -> int | None:
    if _on_gpu(recipe):
        return cluster.gpu_memory

    return psutil.virtual_memory().available // cluster.gpus  # the node's free memory, shared by its processes


def _runtime_bytes(recipe: Recipe) -> int:
    if _on_gpu(recipe):
        return CUDA_CONTEXT

    # now, not the process's peak: measured before the plan reads any config (a first conversion of a built-in
    # target, for one, would count here otherwise)
    return psutil.Process().memory_info().rss


# ------------------------------------------------------------------------------------------------ the models


def target_config(recipe: Recipe, config_path: str | None = None, local_only: bool = False):
    """The target's HF config: from ``config_path`` when given, else the recipe's target (a folder, a built-in, or
    the Hub: config.json only; with ``local_only``, the Hub's only from this machine's HF cache)."""
    source = config_path or resolve_model_dir(recipe.target.model)
    who = f"--target-config {config_path}" if config_path else f"target {recipe.target.model!r}"
    check_source(who, source, recipe.target.trust_remote_code, weights_required=False)
    try:
        return AutoConfig.from_pretrained(source, revision=None if config_path else recipe.target.revision,
                                          trust_remote_code=recipe.target.trust_remote_code,
                                          local_files_only=local_only)
    except (OSError, ValueError) as err:
        raise DrafttrainError(f"cannot read the target's config from {source!r} ({str(err).splitlines()[0]}): "
                              "give --target-config CONFIG.json") from None


FAMILY_WORDS = ("llama", "qwen", "mistral", "mixtral", "gemma", "phi", "deepseek", "olmo", "glm", "falcon", "cohere",
                "exaone", "smollm", "granite", "gpt_oss", "lfm")


def _family_word(name: str) -> str | None:
    name = name.lower().replace("-", "_")
    return next((word for word in FAMILY_WORDS if word in name), None)


def check_config_is_the_target(recipe: Recipe, config, config_path: str) -> None:
    """``--target-config`` must describe the recipe's target: its own config when this machine has it (a folder, a
    built-in, the HF cache: the sizes must agree), else a model of the family the target's name says. The Hub is not
    asked: --target-config is how a plan runs without it (offline, it would wait through its retries)."""
    name, model_type = recipe.target.model, getattr(config, "model_type", "?")
    try:
        own = target_config(recipe, local_only=True)
    except DrafttrainError:
        own = None
    if own is not None:
        sizes = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
        theirs, ours = ([getattr(c.get_text_config(), k, None) for k in sizes] for c in (config, own))
        if theirs != ours:
            raise DrafttrainError(f"--target-config {config_path} is not the recipe's target {name}: "
                                  f"{dict(zip(sizes, theirs))} against {dict(zip(sizes, ours))}")
        return
    named, given = _family_word(name), _family_word(model_type)
    if named is not None and given is not None and named != given:
        raise DrafttrainError(f"--target-config {config_path} describes a {model_type} model, but the recipe's target "
                              f"{name} is a {named} model: give that model's config.json")


def meta_target(recipe: Recipe, config):
    """The target with its real shapes and no storage."""
    dtype = _DTYPES[recipe.target.dtype]
    dtype = getattr(config, "torch_dtype", None) or torch.float32 if dtype == "auto" else dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 trust_remote_code=recipe.target.trust_remote_code)
    return Target(recipe.target.model, model.eval().requires_grad_(False), tokenizer=None)


# ------------------------------------------------------------------------------------------------ the plan


def token_count(recipe: Recipe) -> tuple[int, bool]:
    """Training tokens: counted in the prepared split when there is one, else num_samples rows of half of
    max_length each (stated as an estimate)."""
    split = RunFolder.of(recipe.output_dir).train_split
    if split.is_dir():

        dataset = open_dataset(split)
        return sum(len(ids) for ids in dataset["input_ids"]), True
    if recipe.data.num_samples is None:
        return 0, False  # all of the sources' rows: unknown until prepare has read them
    rows = recipe.data.num_samples * (1 - recipe.data.validation_fraction)
    return int(rows * recipe.data.max_length / 2), False


def cache_bytes_per_token(recipe: Recipe, target: Target, needs) -> int:

    dtype = recipe.training.feature_dtype
    width = cache_dtype(dtype, target).itemsize
    scale = 2 if dtype == "float8" else 0  # its bfloat16 per-token scale
    per_token = len(needs.stored_layers(target.num_layers)) * (target.hidden_size * width + scale)
    if needs.logits and needs.logits_top_k:  # int32 ids and float32 log-probabilities, plus the rest's
        per_token += needs.logits_top_k * 8 + 4
    if keeps_argmax(needs):  # the target's int32 argmax over its whole vocabulary
        per_token += 4
    return per_token


def plan(recipe: Recipe, cluster: Cluster | None = None, stage: str = "train", config_path: str | None = None,
         regen_throughput: float | None = None, capture_throughput: float | None = None,
         train_throughput: float | None = None, draft: ResolvedDraft | None = None) -> Plan:
    """The plan for ``recipe`` on ``cluster`` (default: this machine as launched). ``capture_throughput`` (one
    capture server's prefill tokens/s) and ``train_throughput`` (one training process's tokens/s) say whether a
    stream's servers keep up. ``draft``: the recipe's draft section resolved already (else resolved here)."""
    if recipe.draft is None and stage != "prepare":  # a prepare-only recipe plans its prepare
        raise DrafttrainError("the recipe has no draft section: nothing to train, so nothing to plan for train "
                              "(--stage prepare plans its data stage)")
    runtime = _runtime_bytes(recipe)  # first, before anything else is loaded
    cluster = cluster or this_machine(recipe)
    config = target_config(recipe, config_path)
    if config_path:
        check_config_is_the_target(recipe, config, config_path)
    target = meta_target(recipe, config)
    draft = draft or (resolve_draft(recipe.draft) if recipe.draft is not None else None)
    needs = run_target_needs(draft, target) if draft is not None else TargetNeeds()
    offline = recipe.training.hidden_states == "offline" and recipe.draft is not None
    if stage == "prepare":
        memory, where = _prepare_memory(recipe, target, offline), f"1 process on {'GPU' if _on_gpu(recipe) else 'CPU'}"
    else:
        memory, where = _train_memory(recipe, target, cluster, draft)
    tokens, measured = token_count(recipe) if recipe.data else (0, False)
    result = Plan(stage=stage, where=where, memory={k: int(v) for k, v in {"runtime": runtime, **memory}.items() if v},
                  capacity=_capacity(recipe, cluster), tokens=tokens, tokens_measured=measured)
    if offline:
        result.cache_bytes = tokens * cache_bytes_per_token(recipe, target, needs)
        result.disk_free = cluster.disk_free if cluster.disk_free is not None else _free_disk(recipe)
    if recipe.regenerate.enabled and recipe.data is not None:
        result.regen_tokens = _regenerated_rows(recipe) * recipe.regenerate.max_new_tokens
        if regen_throughput:
            result.regen_seconds = result.regen_tokens / regen_throughput
    if engine_runs_target(recipe) and recipe.draft is not None:
        result.capture = capture_plan(recipe, target, needs, cluster, tokens, capture_throughput, train_throughput,
                                      window_disk_free=_window_disk_free(recipe, cluster))
    if not _on_gpu(recipe):
        result.notes.append("runtime is this process's measured resident memory after the training imports")
    elif cluster.gpu_memory is None:
        result.notes.append("GPU memory unknown: give --gpu-memory GiB")
    if stage == "train":
        result.notes += engine_notes(recipe, target, cluster, result.total)
    return result


def engine_notes(recipe: Recipe, target: Target, cluster: Cluster, per_process: int) -> list[str]:
    """How the serving engine measures checkpoints (eval.engine) and the gate runs, and, inline on a GPU, the
    memory its two servers (the target plain and with the draft) take beside training's."""
    settings, notes = recipe.eval.engine_settings, []
    if recipe.eval.gate:
        notes.append("eval.gate: before training, the consistency gate serves the target in vLLM twice on one row "
                     "(plain, then with a draft overfit on it) and stops the run if the export does not draft what "
                     "the head learned")
    if recipe.eval.engine == "none":
        return notes
    parallelism = (f"TP{settings.tensor_parallel_size} x PP{settings.pipeline_parallel_size} x "
                   f"DP{settings.data_parallel_size}" + (", expert parallel" if settings.expert_parallel else ""))
    if not settings.inline:
        return notes + [f"checkpoints are measured in vLLM ({parallelism}) by `drafttrain watch` on other GPUs or "
                        "another node (eval.engine_settings.inline false): training does not wait for them"]
    notes.append(f"checkpoints are measured in vLLM inline: at each one training waits while two servers ({parallelism},"
                 f" {settings.parallel_gpus} GPU(s) each) start on this node, serve the target plainly and with the "
                 "draft, and stop; the other training processes wait at a barrier meanwhile (the process group's "
                 "timeout, 30 minutes by default, bounds it: a target that loads for long is better measured by "
                 "`drafttrain watch`)")
    if not _on_gpu(recipe) or cluster.gpu_memory is None:
        return notes
    dtype = target.model.dtype if _engine_dtype(recipe) == "auto" else _DTYPES[_engine_dtype(recipe)]
    weights = server_weights(target.model, settings, dtype)[0]
    share = int(settings.memory_fraction * cluster.gpu_memory)
    room = "fits" if per_process + share <= cluster.gpu_memory else \
        "DOES NOT FIT: lower eval.engine_settings.memory_fraction, or measure with `drafttrain watch` elsewhere"
    kv = "leaving room for KV cache" if 2 * weights < share else \
        "more than their share: raise eval.engine_settings.memory_fraction or tensor_parallel_size"
    notes.append(f"the engine's two servers take {settings.memory_fraction:.0%} of each GPU's memory ({_size(share)}) "
                 f"beside training's {_size(per_process)} a process: {room}; each holds {_size(weights)} of the "
                 f"target's weights a GPU, {kv}")
    return notes


def _engine_dtype(recipe: Recipe) -> str:
    dtype = recipe.eval.engine_settings.dtype
    return recipe.target.dtype if dtype == "auto" else dtype


def _prepare_memory(recipe: Recipe, target: Target, offline: bool) -> dict[str, int]:
    """What ``prepare``'s process holds: the target (its head alone when capture engines compute the offline
    cache), and its forward over the widest batch it runs itself."""
    memory = _target_memory(recipe, target, world=1, zero=0, keep=0)
    regenerated = _regeneration_batch_tokens(recipe)  # rows x (prompt + answer): a batch at its widest
    row = _regeneration_row_tokens(recipe)
    # the offline cache's forward, a training batch at a time, unless capture engines run it
    cached = offline and not engine_runs_target(recipe)
    memory["target forward (widest batch)"] = max(
        target_forward_bytes(target, regenerated, row),
        target_forward_bytes(target, _batch_tokens(recipe), _row_length(recipe)) if cached else 0)
    # the batch's tokens, as rows at their longest (shorter rows, more of them: at most as many tokens' worth)
    memory["KV cache (widest regen batch)"] = regenerated * _cache_bytes(target, row) // row if row else 0
    if regenerated and not _on_gpu(recipe):  # the hf backend generates through oneDNN's packed copies
        memory["packed weight copies (regen)"] = packed_weight_bytes(target.model)
    return memory


def _train_memory(recipe: Recipe, target: Target, cluster: Cluster, draft: ResolvedDraft) -> tuple[dict[str, int], str]:
    """What a training process holds, by part, and where the run goes."""
    zero = configured_zero_stage(recipe.training)
    mode = recipe.training.hidden_states
    # counted first: a draft built on the target (Medusa-2's adapters) adds parameters of its own to it
    memory = _target_memory(recipe, target, cluster.world, zero, keep=kept_target_layers(draft))
    try:
        footprint = draft_footprint(recipe, target, draft)
    except DrafttrainError as err:
        if "could not load draft model" not in str(err):
            raise
        raise DrafttrainError(f"{err} `drafttrain plan` takes a model this machine lacks by its config: "
                              "--model-config NAME=CONFIG.json") from None
    memory["draft weights (frozen)"] = footprint["frozen_bytes"]
    memory.update(optimizer_bytes(footprint["trainable"], zero, cluster.world,
                                  recipe.training.mixed_precision == "bf16"))
    if zero:
        memory["DeepSpeed gradient buckets"] = gradient_bucket_bytes(
            recipe, footprint["trainable"], target.model.config.hidden_size)
    memory["activations saved for backward"] = footprint["saved"]
    memory["target outputs (taps, logits)"] = footprint["outputs"]
    online = target_forward_bytes(target, _batch_tokens(recipe), _row_length(recipe)) if mode == "online" else 0
    memory["largest transient"] = max(footprint["transient"], online)
    device = f"GPU ({_size(cluster.gpu_memory)})" if _on_gpu(recipe) and cluster.gpu_memory else \
        ("GPU" if _on_gpu(recipe) else "CPU process")
    source = "hidden states streamed" if mode == "stream" else f"{mode} hidden states"
    if engine_runs_target(recipe):
        source += f" {'from' if mode == 'stream' else 'captured by'} {recipe.capture.engine} servers"
    where = f"{cluster.nodes} node(s) x {cluster.gpus} {device}" + (f", ZeRO-{zero}" if zero else "")
    return memory, f"{where}, {source}"


def _target_memory(recipe: Recipe, target: Target, world: int, zero: int, keep: int) -> dict[str, int]:
    """The target's weights in a process: its head alone (and a draft's ``keep`` start layers) when capture engines
    run its layers, as targets/partial.py loads it; under ZeRO-3 online, its shard and the two layers gathered at a
    time; else all of them."""
    if engine_runs_target(recipe):
        layers = "" if not keep else " + last layer" if keep == 1 else f" + last {keep} layers"
        return {f"target weights (head{layers})": head_bytes(target, keep)}
    whole = sum(_nbytes(p) for p in target.model.parameters())
    if zero != 3 or recipe.training.hidden_states != "online":
        return {"target weights": whole}
    # each layer is gathered whole for its forward, the next one prefetched meanwhile
    layer = max(sum(_nbytes(p) for p in layer.parameters()) for layer in decoder_layers(target.model))
    return {"target weights (ZeRO-3 shard)": whole // world, "target layers gathered (ZeRO-3)": 2 * layer}


def head_bytes(target: Target, keep: int = 0) -> int:
    """The bytes of what targets/partial.py loads: every parameter outside the decoder layers (a tied one once),
    and the last ``keep`` layers whole."""
    layers = decoder_layers(target.model)
    absent = {id(p) for layer in layers[:len(layers) - keep] for p in layer.parameters()}
    return sum(_nbytes(p) for p in target.model.parameters() if id(p) not in absent)


def _row_length(recipe: Recipe) -> int:
    return recipe.data.max_length if recipe.data else 2048


def _batch_tokens(recipe: Recipe) -> int:
    """A training batch at its widest: batch_size rows of data.max_length."""
    return recipe.training.batch_size * _row_length(recipe)


def _regeneration_row_tokens(recipe: Recipe) -> int:
    """One regenerated row at its longest: the longest prompt and the answer."""
    if recipe.data is None:
        return 0
    return recipe.data.max_length + recipe.regenerate.max_new_tokens


def _regeneration_batch_tokens(recipe: Recipe) -> int:
    """The hf regeneration backend's widest batch, in tokens: batch_size rows of the longest prompt and the answer,
    at most regenerate.max_batch_tokens (a row wider than that still runs, alone). 0 when nothing is generated
    here (regeneration off, or a server's backend)."""
    regen = recipe.regenerate
    if not regen.enabled or regen.backend != "hf" or recipe.data is None:
        return 0
    row = _regeneration_row_tokens(recipe)
    widest = regen.batch_size * row
    if regen.max_batch_tokens is not None:
        widest = min(widest, max(regen.max_batch_tokens, row))  # one row over the cap still runs, alone
    return widest


def _regenerated_rows(recipe: Recipe) -> int:
    weights = [(s.weight, recipe.regenerates(s)) for s in recipe.data.sources]
    share = sum(w for w, regen in weights if regen) / sum(w for w, _ in weights)
    return int((recipe.data.num_samples or 0) * share)


def _free_disk(recipe: Recipe, folder: Path | None = None) -> int | None:
    """Free space on the disk of ``folder`` (default: the run folder), or of its nearest existing parent."""
    folder = folder or RunFolder.of(recipe.output_dir).root
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free if folder.exists() else None


def _window_disk_free(recipe: Recipe, cluster: Cluster) -> int | None:
    """Free space on the capture folder's disk, where a stream keeps its window of files (None: not a stream).
    Measured here, beside the run folder's, so that one :func:`_free_disk` answers for every disk the plan reads."""
    if recipe.training.hidden_states != "stream":
        return None
    return cluster.disk_free if cluster.disk_free is not None else _free_disk(recipe, capture_folder(recipe))


def check_fits(recipe: Recipe, stage: str, draft: ResolvedDraft | None = None) -> Plan | None:
    """Run before ``train`` and ``prepare``: refuse, with the plan, a run that clearly cannot fit here (``draft``:
    the recipe's draft section resolved already)."""
    writes_cache = recipe.training.hidden_states == "offline"
    if os.environ.get(SKIP_ENV) == "1" or recipe.draft is None or (
            stage == "prepare" and not writes_cache and not _regeneration_batch_tokens(recipe)):
        return None
    try:
        result = plan(recipe, stage=stage, draft=draft)
    except DrafttrainError:
        return None  # the stage itself reports a target or config it cannot read, with its own message
    except Exception as err:  # noqa: BLE001  (the plan advises; a planner bug must not stop the run itself)
        log.warning("could not plan this run (%s: %s); starting without the memory check", type(err).__name__, err)
        return None
    if result.clearly_cannot_fit:
        raise DrafttrainError(f"this run cannot fit here; the plan:\n{result.render()}\n"
                              f"(set {SKIP_ENV}=1 to start anyway)")
    return result
