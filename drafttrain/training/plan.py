"""What a recipe will need, read from config files alone: memory per process by part, the offline cache on disk,
and the regeneration work. ``drafttrain plan`` prints it; ``train`` and ``prepare`` check it before any work and
refuse when the run clearly cannot fit.

Nothing is downloaded but config.json. The target and the draft are built on the ``meta`` device (shapes, no
storage), so parameter counts are exact for any architecture and any draft kind. Activation memory is measured the
same way: the draft's own ``training_step`` runs once on meta tensors of the recipe's batch and sequence length,
and every tensor autograd saves for the backward pass is counted. The kinds need no formulas of their own.

Per process, on the device the recipe trains on:

* runtime: on CPU, this process's own resident memory after importing what training imports (measured); on a GPU,
  the CUDA context and allocator reserve (an estimate, :data:`CUDA_CONTEXT`);
* the target's weights, split over the processes under ZeRO-3; when capture engines run the target
  (``capture.engine: vllm``), its head alone, as targets/partial.py loads it (everything outside the decoder layers,
  and the last layers a fresh draft starts from);
* the draft's weights, gradients and AdamW states, split as the ZeRO stage splits them;
* DeepSpeed's gradient-reduction buckets, which it allocates at their configured size however small the draft;
* activations saved for the backward pass, the target outputs the step consumes, and the largest transient: one
  chunk of full-vocabulary logits, the backward's working copy of the largest saved tensor, or what the forward
  holds beside its saved tensors at its peak (every storage alive at once in the meta run is counted).

For ``prepare``: the target's weights, its forward over the widest batch (an offline cache's training batch, or a
regeneration batch) and, when the hf backend regenerates in this process, that batch's KV cache and, on a CPU, the
packed copies of the target's linear weights it generates through. Not counted, because not yet explained: resident
memory that grows by about 1 GiB while a batch of 7k-token rows decodes its 256 tokens (its KV cache grows by 47 MiB),
which puts the measured peak of long-row regeneration a fifth above the plan (BENCHMARKS.md, "Regenerating the long
rows in memory the plan counts").

For capture servers (:func:`capture_plan`), per GPU of one server, within the share vLLM may take of it
(``capture.gpu_memory_utilization``): the runtime, its share of the target's weights at the server's parallelism
(:func:`server_weights`; a target published quantized counted as published, :data:`QUANTIZED_BITS`), the prefill
activations and the KV cache of one row (the captured states included), which vLLM needs before it starts; what is
left is KV cache for rows at once. A server that needs more GPUs than a node has is refused. For a stream: the
window of files on the capture folder's disk (``capture.window`` micro-batches of every process), and the tokens
per second all trainers consume against what all servers deliver, refused when the servers cannot keep up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import logging
import math
import os
import shutil
import socket
import tempfile
import weakref
from pathlib import Path

import psutil
import torch
import torch.fx.experimental._config
from accelerate import init_empty_weights
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

# A training process has imported the trainer before it loads anything: the runtime the plan measures includes it.
import drafttrain.training.trainer  # noqa: F401
from drafttrain import DrafttrainError
from drafttrain.config import Recipe
from drafttrain.cpu_linear import packed_weight_bytes
from drafttrain.drafts import drafter_for
from drafttrain.drafts.continuation import ResolvedDraft, kept_target_layers, resolve_draft, run_target_needs
from drafttrain.drafts.lora import add_draft_lora
from drafttrain.drafts.saved import saved_draft_vocab_size
from drafttrain.runfolder import RunFolder, open_dataset
from drafttrain.sources.cache import cache_dtype, keeps_argmax
from drafttrain.sources.choose import capture_folder, engine_runs_target, served_length
from drafttrain.sources.engine import engine_layer_ids
from drafttrain.targets.cache_kinds import cache_bytes
from drafttrain.targets.checks import check_source
from drafttrain.targets.hidden import decoder_layers
from drafttrain.targets.loading import _DTYPES, Target, resolve_model_dir
from drafttrain.targets.outputs import LOGITS_CHUNK, TargetNeeds, TargetOutputs
from drafttrain.training.runtime import configured_zero_stage, read_deepspeed_config

log = logging.getLogger(__name__)

GIB = 2**30
CUDA_CONTEXT = int(1.0 * GIB)  # CUDA context + cuBLAS workspace + allocator slack: an estimate, not measured here
SLACK = 0.8  # the estimate is good to about 20%: a run "clearly cannot fit" when even 80% of it exceeds the memory
SKIP_ENV = "DRAFTTRAIN_SKIP_PLAN"
DEEPSPEED_REDUCE_BUCKET = int(5e8)  # DeepSpeed's default zero_optimization.reduce_bucket_size, in elements


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
        return self.capacity is None or self.total <= self.capacity

    @property
    def disk_fits(self) -> bool:
        return self.cache_bytes is None or self.disk_free is None or self.cache_bytes <= self.disk_free

    @property
    def fits(self) -> bool:
        return self.memory_fits and self.disk_fits and (self.capture is None or self.capture.fits)

    @property
    def clearly_cannot_fit(self) -> bool:
        too_big = self.capacity is not None and SLACK * self.total > self.capacity
        window = self.capture is not None and self.capture.window_clearly_too_big
        return too_big or window or (self.cache_bytes is not None and self.disk_free is not None
                                     and SLACK * self.cache_bytes > self.disk_free)

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


def _size(n: int | float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", GIB), ("MiB", 2**20)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.1f} KiB"


# ------------------------------------------------------------------------------------------------ the machine


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where the run goes: ``gpus`` processes per node (one per GPU; on CPU, processes per machine), ``nodes``
    machines, ``gpu_memory`` bytes per GPU (None on CPU, or when unknown)."""
    gpus: int = 1
    nodes: int = 1
    gpu_memory: int | None = None
    disk_free: int | None = None

    @property
    def world(self) -> int:
        return self.gpus * self.nodes


def this_machine(recipe: Recipe) -> Cluster:
    """The cluster a run launched here has: accelerate's process counts, this device's memory."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    memory = None
    if recipe.target.device.startswith("cuda") and torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return Cluster(gpus=local, nodes=max(world // max(local, 1), 1), gpu_memory=memory)


def read_hostfile(path: str | Path) -> dict[str, int]:
    """A DeepSpeed hostfile (``host slots=N`` per line) as {host: slots}; every host must resolve, so that a typo
    is named now rather than by a launcher that hangs waiting for it."""
    file = Path(path)
    if not file.is_file():
        raise DrafttrainError(f"hostfile not found: {file}")
    hosts: dict[str, int] = {}
    for number, line in enumerate(file.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(" ")
        if not slots.strip().startswith("slots=") or not slots.strip()[6:].isdigit():
            raise DrafttrainError(f"hostfile {file}, line {number}: expected 'HOST slots=N', got {line!r}")
        try:
            socket.getaddrinfo(host, None)
        except OSError:
            raise DrafttrainError(f"hostfile {file}, line {number}: unknown host {host!r} (it does not resolve "
                                  "from this machine)") from None
        hosts[host] = int(slots.strip()[6:])
    if not hosts:
        raise DrafttrainError(f"hostfile {file} names no hosts")
    if len(set(hosts.values())) != 1:
        raise DrafttrainError(f"hostfile {file}: every node needs the same number of slots (GPUs), got {hosts}")
    return hosts


def _on_gpu(recipe: Recipe) -> bool:
    return recipe.target.device.startswith("cuda")


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


@contextlib.contextmanager
def _draft_section(recipe: Recipe, vocab_size: int, resolved: ResolvedDraft):
    """The draft section the run trains with (a continued draft's own); a draft vocabulary that prepare has not
    written yet, or that a continued draft brings, is stood in for by one of its size (only its size matters)."""
    draft, run = resolved.section, RunFolder.of(recipe.output_dir)
    size = None
    if "draft_vocab" in type(draft).model_fields:
        if resolved.saved is not None and not (recipe.draft_vocab.enabled and run.draft_vocab.is_file()):
            # it keeps its own, or extends it by tokens prepare has not counted yet (at least its size)
            size = saved_draft_vocab_size(resolved.saved)
        elif recipe.draft_vocab.enabled and not draft.draft_vocab and not run.draft_vocab.is_file():
            size = recipe.draft_vocab.size
    if size is None:
        yield draft, run
        return

    with tempfile.TemporaryDirectory() as tmp:
        size = min(size, vocab_size)
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[:size] = True
        save_file({"d2t": torch.zeros(size, dtype=torch.long), "t2d": t2d}, f"{tmp}/vocab.safetensors")
        yield draft.model_copy(update={"draft_vocab": f"{tmp}/vocab.safetensors"}), run


class _MetaScalars(torch.utils._python_dispatch.TorchDispatchMode):
    """Lets a training step read a scalar (a metric, a branch) from a meta tensor: it reads 0. Only shapes matter.
    It also notes the largest tensor any operation makes, saved or not (a chunk of attention scores that activation
    checkpointing recomputes in the backward pass is never saved, but exists then), and the peak of the bytes alive
    at once since :meth:`start_peak`: tensors the step still holds that autograd does not save (a loss's full-width
    logits and labels beside their log-probabilities) count there and nowhere else. A storage is alive until its
    last reference, Python's or autograd's, goes."""
    def __init__(self):
        super().__init__()
        self.largest = 0
        self.alive: dict[int, int] = {}  # storage -> bytes
        self.now = self.peak = 0

    def start_peak(self) -> int:
        """Start measuring the peak from here; returns the bytes alive now (parameters, inputs)."""
        self.peak = self.now
        return self.now

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.alive:
            return
        self.alive[key] = storage.nbytes()
        self.now += self.alive[key]
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.now -= self.alive.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return 0
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, _nbytes(t))
                self._track(t)
        return out


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def draft_footprint(recipe: Recipe, target: Target, resolved: ResolvedDraft | None = None) -> dict[str, int]:
    """Parameters of the draft (trainable, frozen) and the bytes one training step holds, from a meta-device run
    of the kind's own code at the recipe's batch size and sequence length."""
    batch_size, seq = recipe.training.batch_size, recipe.data.max_length if recipe.data else 2048
    resolved = resolved or resolve_draft(recipe.draft)
    with _draft_section(recipe, target.vocab_size, resolved) as (section, run), _MetaScalars() as ops:
        # eval mode: the step's own computation and its saved tensors, without the random side paths (on-policy
        # generation, dropout masks) that a meta tensor cannot decide
        with init_empty_weights():  # parameters made on meta, never initialised: an 8B target's took 12 s on a CPU
            drafter = drafter_for(section).build(section, target, run).to("meta").eval()
            if section.draft_lora is not None and not section.builds_with_lora:  # only the adapters train
                add_draft_lora(drafter, section.draft_lora)
        if recipe.training.mixed_precision != "no":  # activations in the half type (autocast, or DeepSpeed's cast)
            drafter.to(torch.bfloat16 if recipe.training.mixed_precision == "bf16" else torch.float16)
        needs = drafter.needs()
        trained_target = set(drafter.trainable_target_parameters())
        batch = {"input_ids": torch.zeros(batch_size, seq, dtype=torch.long, device="meta"),
                 "attention_mask": torch.ones(batch_size, seq, dtype=torch.long, device="meta"),
                 "loss_mask": torch.ones(batch_size, seq, device="meta")}
        outputs = _meta_outputs(target, needs, batch_size, seq)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor):  # a view shares its base's memory: count the base once
            base = t._base if t._base is not None else t
            saved[id(base)] = _nbytes(base)
            return t

        before = ops.start_peak()
        # a loss read at the trained positions alone selects them by the mask; this batch trains every position,
        # which is what meta tensors are told to assume
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True):
            drafter.training_step(batch, outputs)
    own = [p for n, p in drafter.named_parameters() if not n.startswith("target.")]
    trainable = sum(p.numel() for p in own if p.requires_grad)
    trainable += sum(p.numel() for n, p in target.model.named_parameters() if n in trained_target)
    chunk = min(seq, LOGITS_CHUNK) if needs.logits else 0
    largest = max(saved.values(), default=0)
    return {
        "trainable": trainable,
        "frozen": sum(p.numel() for p in own if not p.requires_grad),
        "frozen_bytes": sum(_nbytes(p) for p in own if not p.requires_grad),
        "saved": sum(saved.values()),
        "outputs": sum(_nbytes(t) for t in (outputs.hidden, outputs.final, outputs.logits, outputs.argmax)),
        # one chunk of full logits (and its argmax pass), the backward's copy of the largest saved tensor, a
        # recomputed chunk's working set (its scores, their softmax, and the gradients of both), or what the
        # forward holds beside its saved tensors at its peak
        "transient": max(2 * batch_size * chunk * target.vocab_size * 4, 2 * largest, 3 * ops.largest,
                         ops.peak - before - sum(saved.values())),
    }


def _meta_outputs(target: Target, needs, batch_size: int, seq: int):

    dtype, h = target.model.dtype, target.hidden_size
    shape = (batch_size, seq)
    rows = needs.logits_rows.numel() if needs.logits_rows is not None else target.vocab_size
    return TargetOutputs(
        hidden=torch.zeros(*shape, len(needs.layers) * h, dtype=dtype, device="meta") if needs.layers else None,
        final=torch.zeros(*shape, h, dtype=dtype, device="meta") if needs.final_hidden else None,
        logits=torch.zeros(*shape, rows, dtype=dtype, device="meta") if needs.logits else None,
        argmax=torch.zeros(*shape, dtype=torch.long, device="meta") if needs.logits_rows is not None else None,
    )


# ------------------------------------------------------------------------------------------------ the plan


def optimizer_bytes(trainable: int, stage: int, world: int, bf16: bool) -> dict[str, int]:
    """AdamW training state per process. Without DeepSpeed (or at stage 0) everything is fp32 and whole: weights 4,
    gradients 4, two moments 8 bytes per parameter. DeepSpeed in bf16 keeps bf16 weights and gradients beside an
    fp32 master copy; ZeRO-1 splits the optimizer state, ZeRO-2 the gradients too, ZeRO-3 the weights too."""
    weight, grad = (2, 2) if bf16 and stage else (4, 4)
    optim = 8 + (4 if bf16 and stage else 0)
    split = lambda n, at: n // world if stage >= at else n  # noqa: E731
    return {"draft weights (trainable)": split(trainable * weight, 3),
            "draft gradients": split(trainable * grad, 2),
            "optimizer states (AdamW)": split(trainable * optim, 1)}


def gradient_bucket_bytes(recipe: Recipe, trainable: int, hidden_size: int) -> int:
    """DeepSpeed's gradient-reduction buffers under ``contiguous_gradients`` (its default): ZeRO-1/2 allocate one
    of ``reduce_bucket_size`` elements, two with ``overlap_comm``, in the gradients' dtype (ZeRO-1 stages fp32);
    ZeRO-3 allocates one. The size is the configured one, not the draft's: the H100 check of 2026-11-27 measured
    2 GiB above the plan for a 10M-parameter head under recipes/deepspeed/zero2.json (2 x 5e8 bf16 elements). On a
    CPU the pages a step never writes (torch.empty) are never resident, so at most the trainable parameters count.
    accelerate fills an "auto" bucket size with hidden_size squared."""
    zero = read_deepspeed_config(recipe.training.deepspeed)["zero_optimization"]
    stage = int(zero.get("stage", 0))
    if not zero.get("contiguous_gradients", True):
        return 0
    size = zero.get("reduce_bucket_size", DEEPSPEED_REDUCE_BUCKET)
    size = hidden_size * hidden_size if size == "auto" else int(float(size))
    buffers = 2 if stage in (1, 2) and zero.get("overlap_comm", False) else 1
    low_precision = recipe.training.mixed_precision in ("bf16", "fp16") and stage >= 2
    elements = size if _on_gpu(recipe) else min(size, trainable)
    return buffers * elements * (2 if low_precision else 4)


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
        result.capture = capture_plan(recipe, target, needs, cluster, tokens, capture_throughput, train_throughput)
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
    # the offline cache's forward, a training batch at a time, unless capture engines run it
    cached = _batch_tokens(recipe) if offline and not engine_runs_target(recipe) else 0
    memory["target forward (widest batch)"] = _forward_bytes(max(cached, regenerated), target)
    row = _regeneration_row_tokens(recipe)
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
    online = _forward_bytes(_batch_tokens(recipe), target) if mode == "online" else 0
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


def _forward_bytes(tokens: int, target: Target) -> int:
    """The target's no-grad forward over ``tokens`` tokens: one layer's working set (attention and MLP inputs and
    outputs) plus the residual stream, in the target's dtype."""
    config = target.model.config
    width = 4 * target.hidden_size + 3 * int(getattr(config, "intermediate_size", 4 * target.hidden_size))
    return tokens * width * target.model.dtype.itemsize


def _batch_tokens(recipe: Recipe) -> int:
    """A training batch at its widest: batch_size rows of data.max_length."""
    return recipe.training.batch_size * (recipe.data.max_length if recipe.data else 2048)


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


def _cache_bytes(target: Target, tokens: int, dtype: torch.dtype | None = None, tensor: int = 1,
                 pipeline: int = 1) -> int:
    """What one sequence of ``tokens`` leaves in the target's cache, by each layer's cache kind
    (targets/cache_kinds.py), in the target's dtype (or ``dtype``); over ``tensor`` x ``pipeline`` ranks, one GPU's
    share: its stage's layers (the widest stage) and its heads."""
    per_layer = [positions + states for _, positions, states in
                 cache_bytes(target.model, tokens, (dtype or target.model.dtype).itemsize, tensor)]
    stage = math.ceil(len(per_layer) / pipeline)
    return max(sum(per_layer[i:i + stage]) for i in range(0, len(per_layer), stage))


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


# ------------------------------------------------------------------------------------------------ the capture side

# Bits a weight of a published quantized target takes as the engine holds it, its scales included: mxfp4 packs 32
# values of 4 bits with one 8-bit scale; fp8 keeps a float32 scale per 128 x 128 block. Other methods are counted at
# the served dtype, with a note.
QUANTIZED_BITS = {"mxfp4": 4 + 8 / 32, "fp8": 8 + 32 / (128 * 128)}
TOKEN_ID_BYTES = 8  # a captured file's token ids (int64 at most)
MEASURE_THROUGHPUT = ("a short stream run of one training process against one server measures both: its "
                      "metrics.jsonl logs stream/tokens_per_s_consumed (--train-throughput) and, while training "
                      "waits, stream/tokens_per_s_delivered (--capture-throughput)")


@dataclasses.dataclass
class CapturePlan:
    """The capture servers: memory per GPU of one server by part, the stream's window of files, and the tokens per
    second the trainers consume against what the servers deliver."""
    servers: int  # all of the run's capture servers
    parallelism: str  # e.g. "TP8 x PP1 x DP1, expert parallel"
    server_gpus: int  # GPUs one server takes
    node_gpus: int | None  # GPUs a node has (None: not checked, the target runs on CPU)
    memory: dict[str, int]  # per GPU of one server
    budget: int | None  # what vLLM may take of one GPU: capture.gpu_memory_utilization x its memory
    row_kv: int  # the KV cache and captured states of one row, per GPU
    stream: bool  # training.hidden_states stream; else the servers fill the offline cache in prepare
    capture_tokens: int  # tokens the servers prefill: the train split once, or once an epoch for a stream
    trainers: int  # training processes
    epochs: float = 1.0  # training.epochs
    window_bytes: int | None = None  # a stream's files on the capture folder's disk, every process's window
    disk_free: int | None = None
    capture_rate: float | None = None  # one server's prefill tokens/s (--capture-throughput)
    train_rate: float | None = None  # one training process's tokens/s (--train-throughput)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.memory.values())

    @property
    def gpus_fit(self) -> bool:
        return self.node_gpus is None or self.server_gpus <= self.node_gpus

    @property
    def memory_fits(self) -> bool:
        return self.budget is None or self.total <= self.budget

    @property
    def window_fits(self) -> bool:
        return self.window_bytes is None or self.disk_free is None or self.window_bytes <= self.disk_free

    @property
    def window_clearly_too_big(self) -> bool:
        return self.window_bytes is not None and self.disk_free is not None and SLACK * self.window_bytes > \
            self.disk_free

    @property
    def needed(self) -> float | None:
        """Tokens per second all training processes consume."""
        return None if self.train_rate is None else self.train_rate * self.trainers

    @property
    def delivered(self) -> float | None:
        """Tokens per second all servers deliver."""
        return None if self.capture_rate is None else self.capture_rate * self.servers

    @property
    def keeps_up(self) -> bool:
        return not self.stream or self.needed is None or self.delivered is None or self.delivered >= self.needed

    @property
    def fits(self) -> bool:
        return self.gpus_fit and self.memory_fits and self.window_fits and self.keeps_up

    def verdicts(self) -> dict:
        return {"total": self.total, "needed": self.needed, "delivered": self.delivered, "gpus_fit": self.gpus_fit,
                "memory_fits": self.memory_fits, "window_fits": self.window_fits, "keeps_up": self.keeps_up,
                "fits": self.fits}

    def render(self) -> list[str]:
        node = "" if self.node_gpus is None else \
            f", a node has {self.node_gpus}: {'fits' if self.gpus_fit else 'DOES NOT FIT'}"
        lines = [f"capture servers: {self.servers} x vLLM at {self.parallelism}, {self.server_gpus} GPU(s) each{node}",
                 "memory per GPU of a server:"]
        lines += [f"  {name:<34} {_size(value):>10}" for name, value in self.memory.items()]
        if self.budget is None:
            lines.append(f"  {'total':<34} {_size(self.total):>10}   available unknown")
        else:
            rows = int((self.budget - self.total) // self.row_kv) + 1  # the total holds one row already
            verdict = f"fits, KV cache for {rows:,} rows at once" if self.memory_fits else "DOES NOT FIT"
            lines.append(f"  {'total':<34} {_size(self.total):>10}   vLLM may use {_size(self.budget)}: {verdict}")
        if self.window_bytes is not None:
            free = "unknown" if self.disk_free is None else _size(self.disk_free)
            lines.append(f"stream window: {_size(self.window_bytes)} of files on the capture folder's disk "
                         f"({self.trainers} process(es)), {free} free: {'fits' if self.window_fits else 'DOES NOT FIT'}")
        return lines + self._throughput_lines()

    def _throughput_lines(self) -> list[str]:
        when = "once an epoch" if self.stream else "once, in prepare"
        at = "" if not self.delivered else \
            f", about {self.capture_tokens / self.delivered / 3600:.1f} h at the stated throughput"
        lines = [f"capture: {self.capture_tokens:,} tokens prefilled ({when}){at}"]
        need = "?" if self.needed is None else f"{self.trainers} x {self.train_rate:,.0f} = {self.needed:,.0f}"
        if not self.stream:
            lines += [] if self.delivered else ["  (give --capture-throughput for a time)"]
            if self.needed:  # the servers are done before training starts: only its time to tell
                trained = self.capture_tokens * self.epochs
                lines.append(f"training from the cache: {trained:,.0f} tokens ({self.epochs:g} epochs) at {need} "
                             f"tokens/s, about {trained / self.needed / 3600:.1f} h")
            return lines
        give = "?" if self.delivered is None else f"{self.servers} x {self.capture_rate:,.0f} = {self.delivered:,.0f}"
        line = f"stream: the trainers consume {need} tokens/s, the servers deliver {give} tokens/s"
        if self.needed is None or self.delivered is None:
            missing = [flag for flag, value in (("--train-throughput", self.needed), ("--capture-throughput",
                                                                                      self.delivered)) if value is None]
            return lines + [f"{line}: give {' and '.join(missing)} to check that they keep up; {MEASURE_THROUGHPUT}"]
        if self.keeps_up:
            return lines + [f"{line}: keeps up ({self.delivered / self.needed:.2f} x what training consumes)"]
        short = self.needed - self.delivered
        return lines + [f"{line}: CANNOT KEEP UP, {short:,.0f} tokens/s short: the trainers would wait "
                        f"{100 * short / self.needed:.0f}% of the time; {math.ceil(self.needed / self.capture_rate)} "
                        "servers would keep up"]


def capture_plan(recipe: Recipe, target: Target, needs: TargetNeeds, cluster: Cluster, tokens: int,
                 capture_rate: float | None = None, train_rate: float | None = None) -> CapturePlan:
    """The capture side of ``recipe``: its servers on nodes like the trainers' (``cluster.gpus`` GPUs of
    ``cluster.gpu_memory`` each), the ``cluster.world`` training processes they feed."""
    settings, on_gpu = recipe.capture, _on_gpu(recipe)
    stream = recipe.training.hidden_states == "stream"
    dtype = target.model.dtype if settings.dtype == "auto" else _DTYPES[settings.dtype]
    length, taps = served_length(recipe), len(engine_layer_ids(needs, target.num_layers))
    captured = taps * target.hidden_size * dtype.itemsize  # one token's states in a captured file
    row_kv = _cache_bytes(target, length, dtype, settings.tensor_parallel_size,
                          settings.pipeline_parallel_size) + length * captured
    weights, label, notes = server_weights(target.model, settings, dtype)
    memory = {"runtime (CUDA context)": CUDA_CONTEXT if on_gpu else 0, label: weights,
              "prefill activations, 1 row": _forward_bytes(length, target) // settings.tensor_parallel_size,
              "KV cache + captured states, 1 row": row_kv}
    parallelism = (f"TP{settings.tensor_parallel_size} x PP{settings.pipeline_parallel_size} x "
                   f"DP{settings.data_parallel_size}" + (", expert parallel" if settings.expert_parallel else ""))
    result = CapturePlan(
        servers=len(settings.urls) or settings.servers * cluster.nodes, parallelism=parallelism,
        server_gpus=settings.parallel_gpus, node_gpus=cluster.gpus if on_gpu else None,
        memory={k: int(v) for k, v in memory.items() if v}, row_kv=row_kv, stream=stream,
        budget=int(settings.gpu_memory_utilization * cluster.gpu_memory) if on_gpu and cluster.gpu_memory else None,
        capture_tokens=int(tokens * (recipe.training.epochs if stream else 1)), trainers=cluster.world,
        epochs=recipe.training.epochs,
        capture_rate=capture_rate, train_rate=train_rate, notes=notes)
    if stream:
        per_row = (recipe.data.max_length if recipe.data else 2048) * (captured + TOKEN_ID_BYTES)
        result.window_bytes = cluster.world * settings.window * recipe.training.batch_size * per_row
        result.disk_free = cluster.disk_free if cluster.disk_free is not None else \
            _free_disk(recipe, capture_folder(recipe))
    if not settings.urls and on_gpu:
        result.notes.append(f"the {settings.servers} capture server(s) started on each trainer node take "
                            f"{settings.servers * settings.parallel_gpus} of its GPUs besides the trainers' own")
    return result


def server_weights(model: torch.nn.Module, settings, dtype: torch.dtype) -> tuple[int, str, list[str]]:
    """One GPU's share of the target's weights in a capture server, at its heaviest pipeline stage: tensor x
    pipeline parallelism splits every weight (the first stage holds the embeddings, the last the final norm and the
    lm_head, a tied one a copy of its own); data parallelism replicates the model, except that with expert
    parallelism the routed experts are split over tensor x data ranks instead (attention stays split over tensor
    ranks alone). Returns the bytes, the line's name and notes."""
    tp, pp, dp = settings.tensor_parallel_size, settings.pipeline_parallel_size, settings.data_parallel_size
    bits, skip, notes = _quantization(model.config, dtype)
    layers = decoder_layers(model)
    sizes = [len(layers) // pp + (stage < len(layers) % pp) for stage in range(pp)]
    stage_of = [stage for stage, count in enumerate(sizes) for _ in range(count)]
    layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
    embedding = {id(p) for p in model.get_input_embeddings().parameters()}
    experts = expert_parameter_names(model)
    expert_split = tp * (dp if settings.expert_parallel else 1)
    stages = [0.0] * pp
    for name, p in model.named_parameters():
        layer = layer_of.get(id(p))
        stage = stage_of[layer] if layer is not None else (0 if id(p) in embedding else pp - 1)
        stages[stage] += _served_bytes(name, p, layer is not None, dtype, bits, skip) / \
            (expert_split if name in experts else tp)
    head = model.get_output_embeddings()
    if pp > 1 and head is not None:  # a head tied to the embeddings: the last stage holds its own copy
        stages[-1] += sum(p.numel() * dtype.itemsize for p in head.parameters() if id(p) in embedding) / tp
    if settings.expert_parallel and not experts:
        notes.append("capture.expert_parallel: the target has no routed experts to split")
    split = f", experts over {expert_split}" if experts and expert_split != tp else ""
    return int(max(stages)), f"target weights (TP{tp} x PP{pp}{split})", notes


def expert_parameter_names(model: torch.nn.Module) -> set[str]:
    """The routed experts' parameters: those under a module named ``experts`` or of a class named ``...Experts``,
    as every MoE family in transformers builds them (shared experts are named otherwise, and split as dense)."""
    roots = [name + "." for name, module in model.named_modules()
             if name.rsplit(".", 1)[-1] == "experts" or type(module).__name__.endswith("Experts")]
    return {name for name, _ in model.named_parameters() if any(name.startswith(root) for root in roots)}


def _quantization(config, dtype: torch.dtype) -> tuple[float | None, tuple[str, ...], list[str]]:
    """How a target published quantized is held: bits a quantized value takes, the module patterns left out, and
    a note saying so (None: every weight at ``dtype``)."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None, (), []
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method, kind = quant.get("quant_method"), str(dtype).removeprefix("torch.")
    if method not in QUANTIZED_BITS:
        return None, (), [f"the target's quantization_config ({method}) is not counted: its weights count at {kind}, "
                          "more than the engine holds"]
    skip = tuple(quant.get("modules_to_not_convert") or quant.get("ignored_layers") or ())
    left = f"; {', '.join(skip)} at {kind}" if skip else ""
    return QUANTIZED_BITS[method], skip, [f"capture server weights as published ({method}): the decoder layers' "
                                          f"weight matrices at {QUANTIZED_BITS[method]:.3g} bits a value{left}"]


def _served_bytes(name: str, param: torch.Tensor, in_layer: bool, dtype: torch.dtype, bits: float | None,
                  skip: tuple[str, ...]) -> float:
    quantized = bits is not None and in_layer and param.dim() >= 2 and not name.endswith("bias") and not any(
        fnmatch.fnmatch(name, pattern) or fnmatch.fnmatch(name, pattern + ".*") for pattern in skip)
    return param.numel() * (bits / 8 if quantized else dtype.itemsize)
