"""Building blocks of the draft heads: a Llama-style decoder layer with its own small KV cache, and label shifts.

HF's own pieces (RMSNorm, MLP, rotary embedding, ``rotate_half``, ``repeat_kv``) are used as they are;
only the attention is ours, because the heads need two things HF's layer does not offer: EAGLE-3's 2H-wide
attention input, and the training-time-test pattern (causal over the real prefix + one diagonal key per
unrolled step) without materialising a (k·T)² mask, and P-EAGLE's mask slots (a mask built in chunks of query
rows, :class:`RowMask`), so neither holds a long row's square. Parameter names match HF Llama, so checkpoints load in
vLLM / SGLang without renaming.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, repeat_kv, rotate_half

from drafttrain import DrafttrainError
from drafttrain.targets import Target
from drafttrain.targets.family import draft_layer_fields

log = logging.getLogger(__name__)


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded with zeros at the end back to x's length (dim 1): position t then holds t+n's value."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1) if n < x.shape[1] else torch.zeros_like(x)


@dataclasses.dataclass
class LayerCache:
    """Keys/values of one draft layer, (batch, kv_heads, length, head_dim), before GQA repetition, and the sequence
    position of each entry (tree drafting caches entries out of position order; a sliding window reads them)."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor,
               positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is None:  # in order after what is cached
            positions = torch.arange(self.length, self.length + keys.shape[2], device=keys.device)
        if self.keys is None:
            self.keys, self.values, self.positions = keys, values, positions
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
            self.positions = torch.cat([self.positions, positions])
        return self.keys, self.values

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]
            self.positions = self.positions[:length]

    def keep(self, positions: torch.Tensor) -> None:
        """Keep only the given cache entries (indices, in order): used to keep the accepted tree path."""
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, positions], self.values[:, :, positions]
            self.positions = self.positions[positions]


def within_window(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """(T, S) True where a key lies among the last ``window`` positions up to its query (the query's own included),
    as vLLM and Hugging Face count a sliding window."""
    return (query_positions[:, None] - key_positions[None, :]) < window


class RowMask:
    """A boolean attention mask too large to hold whole for a long row, built a block of query rows at a time:
    ``rows(start, end)`` is (end - start, keys), True = see. DraftAttention attends with it in chunks of queries."""

    keys: int

    def rows(self, start: int, end: int) -> torch.Tensor:
        raise NotImplementedError


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x (B, heads, T, head_dim) with HF's cos/sin (B, T, rotary width). A rotary
    width below the head's (a target with ``partial_rotary_factor``: Phi-4-mini rotates 96 of 128) rotates the
    first dimensions and passes the rest, as the target's own attention does."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned, passed = x[..., :width], x[..., width:]
    return torch.cat([turned * cos + rotate_half(turned) * sin, passed], dim=-1)


class DraftAttention(nn.Module):
    def __init__(self, config: LlamaConfig, input_size: int):
        super().__init__()
        self.window = getattr(config, "sliding_window", None)  # None: every earlier key
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False)
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        return q, k, v

    def _out(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x, cos, sin, cache: LayerCache, mask: torch.Tensor | None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Inference: append this chunk's keys to ``cache`` and attend with a boolean ``mask`` (True = see).

        ``mask`` is (T, S) or (B, 1, T, S) over the whole cache, or a :class:`RowMask` (built in chunks of queries);
        None means causal within the chunk. ``positions`` (T,): the chunk's sequence positions (default: right after
        the cache), which a sliding window reads.
        """
        q, k, v = self._project(x, cos, sin)
        keys, values = cache.append(k, v, positions)
        rep = self.num_heads // self.num_kv_heads
        if isinstance(mask, RowMask):
            if self.window is not None:
                raise DrafttrainError("a sliding-window draft attention takes a whole mask, not one built by rows")
            return self._out(row_mask_attention(q, repeat_kv(keys, rep), repeat_kv(values, rep), mask))
        if mask is None:
            past = keys.shape[2] - q.shape[2]
            mask = torch.ones(q.shape[2], keys.shape[2], dtype=torch.bool, device=x.device).tril(past)
        if self.window is not None:  # the chunk's own positions are the cache's last ones
            mask = mask & within_window(cache.positions[-q.shape[2]:], cache.positions, self.window)
        attn = F.scaled_dot_product_attention(q, repeat_kv(keys, rep), repeat_kv(values, rep), attn_mask=mask)
        return self._out(attn)

    def forward_ttt(self, x, cos, sin, blocks: list[tuple[torch.Tensor, torch.Tensor]]):
        """Training-time test: step i of an unrolled draft (i = len(blocks)).

        Position t sees the real prefix keys of step 0 at positions <= t, and its own keys of steps 1..i at
        position t only (its own drafted path). ``blocks`` holds earlier steps' (k, v) and gains this step's.
        Long rows are attended in chunks of queries (:func:`ttt_attention`), so memory grows linearly in T.
        """
        q, k, v = self._project(x, cos, sin)
        blocks.append((k, v))
        rep = self.num_heads // self.num_kv_heads
        return self._out(ttt_attention(q, blocks, rep, self.head_dim**-0.5, window=self.window))


# Scores one chunk of queries may hold, per batch row and head: (queries x keys) <= this. 2**22 keeps rows up to 2k
# tokens in one piece (today's cost, no recomputation) and bounds an 8k row's working set to 1/16 of its square.
TTT_SCORES_PER_CHUNK = 2**22


def ttt_chunk(length: int) -> int:
    """Queries per chunk for a row of ``length`` tokens: the whole row when its square fits the budget."""
    return length if length * length <= TTT_SCORES_PER_CHUNK else max(64, TTT_SCORES_PER_CHUNK // length)


def ttt_attention(q: torch.Tensor, blocks: list[tuple[torch.Tensor, torch.Tensor]], rep: int, scale: float,
                  chunk: int | None = None, window: int | None = None) -> torch.Tensor:
    """The training-time test's attention, (B, h, T, hd), in chunks of queries. A chunk's scores reach only the
    prefix it can see (keys up to its last query, and within the sliding ``window`` when there is one) and are
    recomputed in the backward pass (activation checkpointing), so what a step keeps for backward is linear in T
    and the working set is one chunk's. Rows that fit one chunk run as one piece, without recomputation.

    At unrolled step i the query at t stands for the draft at position t + i, so a window of W keeps the real keys
    after t + i - W (its own drafted keys, i of them, are always inside a window longer than the unrolled steps)."""
    t, step = q.shape[2], len(blocks) - 1
    chunk = chunk or ttt_chunk(t)
    if chunk >= t:
        return _ttt_chunk_attention(q, blocks[0][0], blocks[0][1], blocks[1:], 0, 0, rep, scale, window)
    outs = []
    for start in range(0, t, chunk):
        end = min(start + chunk, t)
        first = 0 if window is None else max(0, start + step - window + 1)  # no query of the chunk sees before it
        diagonal = [(kd[:, :, start:end], vd[:, :, start:end]) for kd, vd in blocks[1:]]
        outs.append(checkpoint(_ttt_chunk_attention, q[:, :, start:end], blocks[0][0][:, :, first:end],
                               blocks[0][1][:, :, first:end], diagonal, start, first, rep, scale, window,
                               use_reentrant=False))
    return torch.cat(outs, dim=2)


def _ttt_chunk_attention(q, k0, v0, diagonal, start: int, first: int, rep: int, scale: float,
                         window: int | None = None) -> torch.Tensor:
    """Queries at positions start.. (q: B, h, c, hd) over the real prefix k0/v0 (positions first.., causal, within
    the window) and each one's own keys of the unrolled steps (``diagonal``: (k, v) per step, aligned with q); one
    softmax."""
    c, s = q.shape[2], k0.shape[2]
    k0, v0 = repeat_kv(k0, rep), repeat_kv(v0, rep)
    scores = torch.matmul(q, k0.transpose(2, 3)) * scale  # (B, h, c, s)
    queries = torch.arange(start, start + c, device=q.device)
    keys = torch.arange(first, first + s, device=q.device)
    visible = keys[None, :] <= queries[:, None]
    if window is not None:
        visible = visible & within_window(queries + len(diagonal), keys, window)
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    diag = [(q * repeat_kv(kd, rep)).sum(-1, keepdim=True) * scale for kd, _ in diagonal]  # (B, h, c, 1)
    weights = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(weights[..., :s], v0)
    for j, (_, vd) in enumerate(diagonal):
        out = out + weights[..., s + j : s + j + 1] * repeat_kv(vd, rep)
    return out


# Entries of a RowMask held at once. A row whose whole mask fits runs as one piece: PyTorch's fused attention (CPU
# and CUDA) never holds the scores, so the mask itself (one byte an entry, and kept for backward) is what grows
# with the square; rows up to about 1.2k tokens at 8 P-EAGLE depths (4k queries) fit. Longer rows go in chunks,
# each recomputed in backward: measured on the CPU, chunking a 768-token row cost 12% of the step (2.35 s
# against 2.10 s), so short rows keep the whole mask.
ROW_MASK_ENTRIES = 2**24


def row_mask_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: RowMask,
                       chunk: int | None = None) -> torch.Tensor:
    """Attention with a :class:`RowMask`, in chunks of queries once the whole mask would exceed ROW_MASK_ENTRIES:
    each chunk's mask rows and scores are built in its forward and again in its backward (activation
    checkpointing), so what is kept for backward is linear in the queries and the working set is one chunk's."""
    t, s = q.shape[2], keys.shape[2]
    chunk = chunk or (t if t * s <= ROW_MASK_ENTRIES else max(64, ROW_MASK_ENTRIES // s))
    if chunk >= t:
        return _row_mask_chunk(q, keys, values, mask, 0)
    outs = [checkpoint(_row_mask_chunk, q[:, :, start:start + chunk], keys, values, mask, start, use_reentrant=False)
            for start in range(0, t, chunk)]
    return torch.cat(outs, dim=2)


def _row_mask_chunk(q, keys, values, mask: RowMask, start: int) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.rows(start, start + q.shape[2]))


class DraftDecoderLayer(nn.Module):
    """A Llama decoder layer. With ``fuse_embedding`` (EAGLE-3's first layer) the attention reads
    [input_layernorm(token embedding), hidden_norm(hidden)] (2H wide) and the hidden is the residual.
    Without it (EAGLE-1) the input is the fc-fused feature itself, un-normed as in EAGLE-1's layer 0."""

    def __init__(self, config: LlamaConfig, fuse_embedding: bool, input_norm: bool = True):
        super().__init__()
        h = config.hidden_size
        self.fuse_embedding = fuse_embedding
        self.self_attn = DraftAttention(config, 2 * h if fuse_embedding else h)
        self.mlp = LlamaMLP(config)
        if fuse_embedding:
            self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        elif input_norm:
            self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)

    def _attn_input(self, hidden: torch.Tensor, embeds: torch.Tensor | None) -> torch.Tensor:
        if self.fuse_embedding:
            return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        return self.input_layernorm(hidden) if hasattr(self, "input_layernorm") else hidden

    def _mlp_block(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, hidden, embeds, cos, sin, cache: LayerCache, mask=None, positions=None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self._attn_input(hidden, embeds), cos, sin, cache, mask, positions)
        return self._mlp_block(hidden)

    def forward_ttt(self, hidden, embeds, cos, sin, blocks) -> torch.Tensor:
        hidden = hidden + self.self_attn.forward_ttt(self._attn_input(hidden, embeds), cos, sin, blocks)
        return self._mlp_block(hidden)


@torch.no_grad()
def copy_target_layer(draft: DraftDecoderLayer, source: nn.Module) -> None:
    """Make a draft layer compute what a target decoder layer computes on its hidden input. For EAGLE-3's first
    layer (attention over [embedding, hidden], 2H wide) the embedding half of q/k/v starts at zero, so at step 0
    the token embedding is ignored and it learns to use it."""
    own = dict(draft.named_parameters())
    theirs = dict(source.named_parameters())
    renamed = {"input_layernorm.weight": "hidden_norm.weight" if draft.fuse_embedding else "input_layernorm.weight"}
    for name, value in theirs.items():
        mine = own.get(renamed.get(name, name))
        if mine is None and name == "input_layernorm.weight":  # EAGLE-1's first layer has no input norm
            continue
        if mine is None and name.endswith(("q_norm.weight", "k_norm.weight")):  # Qwen3's per-head q/k norms
            log.info("draft.init_from_target 'layer': the draft layer has no %s; the rest is copied", name)
            continue
        if mine is None:  # an MoE, MLA or gated-attention layer: no Llama-style draft layer computes it
            raise DrafttrainError(f"draft.init_from_target 'layer': the target's last layer is not a dense "
                                  f"Llama-style layer ({name} {tuple(value.shape)} has no counterpart in the draft "
                                  "layer): leave 'layer' out of init_from_target for this target")
        if mine.shape == value.shape:
            mine.copy_(value)
        elif draft.fuse_embedding and name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) \
                and mine.shape == (value.shape[0], 2 * value.shape[1]):
            mine.zero_()
            mine[:, value.shape[1]:] = value
        else:
            advice = "set intermediate_size to the target's" if name.startswith("mlp.") else \
                "leave 'layer' out of init_from_target for this target"
            raise DrafttrainError(f"draft.init_from_target 'layer': cannot start from the target's layer: {name} is "
                                  f"{tuple(value.shape)} there, {tuple(mine.shape)} in the draft ({advice})")


class DraftLayerConfig(LlamaConfig):
    """A Llama config whose head size is given (the target's): the width need not then be a multiple of the head
    count, as Qwen3.5-27B's (5120 wide, 24 heads of 256) and GLM-4.5's (4096 wide, 96 heads of 128) are not;
    transformers' LlamaConfig refuses those even with an explicit head size. It is saved as a plain Llama config."""

    def validate_architecture(self):
        if self.head_dim is None:
            super().validate_architecture()


def llama_config_like(target_config, **overrides) -> LlamaConfig:
    """A Llama config for a draft layer shaped like the target's (heads, widths, RoPE: targets.family)."""
    fields = dict(draft_layer_fields(target_config), num_hidden_layers=1, tie_word_embeddings=False)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return DraftLayerConfig(**fields)


def resolve_mask_token(configured: int | None, target: Target, field: str = "draft.mask_token_id") -> int:
    """The mask token: the recipe's; else the tokenizer's mask token; else the first embedding row no token uses;
    else unk / pad / eos (as the references choose it). ``field`` names the recipe's setting in an error."""
    tokenizer, vocab = target.tokenizer, target.vocab_size
    if tokenizer is None and configured is None:  # a target known by its config alone (`drafttrain plan`): any row
        return vocab - 1
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else vocab
    candidates = [configured, getattr(tokenizer, "mask_token_id", None), size if size < vocab else None,
                  *(getattr(tokenizer, f"{name}_token_id", None) for name in ("unk", "pad", "eos"))]
    chosen = next((c for c in candidates if c is not None), None)
    if chosen is None or not 0 <= chosen < vocab:
        raise DrafttrainError(f"{field} {chosen!r} is not a row of the target's {vocab}-token embeddings")
    return int(chosen)


# what speculators' checkpoints carry beside the draft: copies of the target's embeddings and its norm / lm_head
FOREIGN_EXTRAS = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")


def foreign_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A foreign draft's own tensors (the target's copies left out), floating point in fp32 as drafttrain trains."""
    return {k: v.float() if v.is_floating_point() else v for k, v in tensors.items() if k not in FOREIGN_EXTRAS}


def check_target_sizes(config: dict, target: Target, whose: str = "the draft's") -> None:
    """A draft's hidden and vocabulary sizes (as its config.json gives them) against the target's: a draft of
    another size was trained for another target."""
    for what, mine in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if config[what] != mine:
            raise DrafttrainError(f"{whose} {what} is {config[what]}, the target {target.name!r} has {mine}: it was "
                                  "trained for another target")


def check_foreign_layers(config: dict, target: Target) -> None:
    """Our draft layers take the target's shape, norm epsilon, activation and RoPE (``llama_config_like``): a
    foreign draft whose layers differ in any of them would load and compute something else, so it is refused."""
    layer, ours = config["transformer_layer_config"], llama_config_like(target.config)
    check_target_sizes(layer, target)
    checks = [("target_hidden_size", config.get("target_hidden_size") or target.hidden_size, target.hidden_size),
              ("num_attention_heads", layer["num_attention_heads"], ours.num_attention_heads),
              ("num_key_value_heads", layer["num_key_value_heads"], ours.num_key_value_heads),
              ("head_dim", layer.get("head_dim"), ours.head_dim),
              ("rms_norm_eps", layer.get("rms_norm_eps"), ours.rms_norm_eps),
              ("hidden_act", layer.get("hidden_act"), ours.hidden_act),
              ("rope_theta", (layer.get("rope_parameters") or {}).get("rope_theta", layer.get("rope_theta")),
               ours.rope_parameters.get("rope_theta")),
              ("rope_type", (layer.get("rope_parameters") or layer.get("rope_scaling") or {}).get("rope_type", "default"),
               ours.rope_parameters.get("rope_type", "default"))]
    for what, theirs, mine in checks:
        if theirs != mine:
            raise DrafttrainError(f"the draft's {what} is {theirs}, the target {target.name!r} has {mine} (drafttrain "
                                  "builds draft layers like the target's): it was trained for another target")
