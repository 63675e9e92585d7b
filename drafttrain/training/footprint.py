"""A draft measured on the ``meta`` device (shapes, no storage), so its parameter counts are exact for any draft
kind. Its activation memory is measured the same way: the draft's own ``training_step`` runs once on meta tensors
of the recipe's batch and sequence length, and every tensor autograd saves for the backward pass is counted, with
the largest tensor any operation makes and the peak of the bytes alive at once (:class:`_MetaScalars`). The kinds
need no formulas of their own.

The target's own forward (:func:`target_forward_bytes`: what a regeneration batch, an offline cache's batch or an
online training batch holds at its peak beside the weights) is measured the same way: the model's forward runs once
on meta tensors, so a family's experts, eager attention scores or recurrent chunks count as its code makes them.

Beside it, what training keeps for the trainable parameters: AdamW's states, split as the ZeRO stage splits them
(:func:`optimizer_bytes`), and DeepSpeed's gradient-reduction buckets at their configured size
(:func:`gradient_bucket_bytes`).
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import weakref

import torch
import torch.fx.experimental._config
from accelerate import init_empty_weights
from safetensors.torch import save_file

from drafttrain.config import Recipe
from drafttrain.drafts import drafter_for
from drafttrain.drafts.continuation import ResolvedDraft, resolve_draft
from drafttrain.drafts.lora import add_draft_lora
from drafttrain.drafts.saved import saved_draft_vocab_size
from drafttrain.runfolder import RunFolder
from drafttrain.targets.loading import Target
from drafttrain.targets.outputs import LOGITS_CHUNK, TargetOutputs
from drafttrain.training.runtime import read_deepspeed_config
from drafttrain.training.sizes import _on_gpu

DEEPSPEED_REDUCE_BUCKET = int(5e8)  # DeepSpeed's default zero_optimization.reduce_bucket_size, in elements


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


class _ForwardOnMeta(_MetaScalars):
    """:class:`_MetaScalars` for a target's forward: the model's parameters and buffers are not counted (the plan
    counts its weights), and grouped expert matmuls, whose meta kernel takes bfloat16 alone, are shaped here."""
    def known(self, tensor: torch.Tensor) -> None:
        self.alive.setdefault(tensor.untyped_storage()._cdata, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._grouped_mm.default and args[0].is_meta and args[0].dim() == 2 \
                and args[1].dim() == 3:  # tokens sorted by expert [S, K] x each expert's [E, K, N]
            out = torch.empty(args[0].shape[0], args[1].shape[-1], dtype=args[0].dtype, device="meta")
            self.largest = max(self.largest, _nbytes(out))
            self._track(out)
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def _fused_attention():
    """SDPA as its fused CPU and GPU kernels hold it: the output alone, never a [rows, heads, L, L] score matrix,
    which SDPA's reference path on the meta device would make."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fused(query, key, value, *args, **kwargs):
        return query.new_empty(*query.shape[:-1], value.shape[-1])

    torch.nn.functional.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa


def target_forward_bytes(target: Target, tokens: int, row: int) -> int:
    """What the target's no-grad forward (no cache; the logits of the last position only, as generation's prefill
    and run_target compute them) holds at its peak beside its weights, over ``tokens`` tokens in rows of ``row``:
    one row measured on the meta device (``target.model`` is there) under a padded batch's attention mask, times
    the rows, since a forward's memory grows with its rows. Quadratic parts (eager attention's scores, the mask)
    are measured at the row's own length."""
    if not tokens or not row:
        return 0
    model = target.model
    with _ForwardOnMeta() as ops, torch.no_grad(), _fused_attention(), \
            torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True):
        for tensor in (*model.parameters(), *model.buffers()):
            ops.known(tensor)
        ids = torch.zeros(1, row, dtype=torch.long, device="meta")
        before = ops.start_peak()
        # a mask that is not all ones (its meta scalars read 0): the padded batch regeneration runs
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=1)
    return math.ceil((ops.peak - before) * tokens / row)


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
