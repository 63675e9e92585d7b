"""The cache of a model being decoded, rolled back exactly after each verification, whatever the family.

A verification feeds [root, draft tokens...] in one forward and keeps only the accepted path. Afterwards every layer
must hold exactly what it would hold had the refused tokens never been fed:

* full attention (and MLA, whose cache holds per-position keys and values too): positions are dropped, or moved
  into place for a tree's accepted path;
* sliding-window and chunked attention: transformers' past-state recording keeps the positions a window would have
  dropped until the rollback, which then trims the layer back to its window;
* short convolutions (LFM2): past-state recording keeps the convolution's inputs likewise;
* recurrent states (linear attention and SSM layers: Qwen3-Next, Qwen3.5, Falcon-H1, Kimi Linear) have no positions
  to drop. A forward of a few tokens (a verification) asks transformers to record the state after each of them
  (``recurrent_states_to_keep``, which runs those tokens through the layer's one-token kernel): a rollback then
  takes the recorded state of the last kept token, exactly what the cache held after it, with nothing run again.
  Where nothing was recorded (a long forward such as a prefill, a model that ignores the request, an older
  transformers) the states copied before the forward are restored and the kept tokens fed again.

A tree is verified in one forward through attention alone: each layer type gets the ancestor mask in its own shape
(the keys its cache returns, its window or chunk applied at the nodes' depth positions). A recurrent or convolution
layer would mix the branches in feed order, so those caches refuse trees (``supports_trees``), as engines do.

Each layer is treated by its cache kind (targets/cache_kinds.py: what it holds, whether trees pass through it).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

from drafttrain import DrafttrainError
from drafttrain.targets.cache_kinds import CacheKind, kind_of
from drafttrain.targets.masks import model_forward

# positions a window or convolution layer keeps beyond what its next forward reads, and recurrent states kept per
# layer: a rollback that follows a trim (a proposal timed again, the end of a generate call) still finds them. A
# forward of at most this many tokens records a recurrent state per token; a longer one (a prefill) runs chunked.
RECORDED_MARGIN = 64
_STATE_FIELDS = ("conv_states", "recurrent_states", "has_previous_state", "is_conv_states_initialized",
                 "is_recurrent_states_initialized", "conv_kernel_size")


def tree_refusal(model: torch.nn.Module, cannot: str = "verify a tree's branches side by side",
                 instead: str = "Use a chain (--tree chain)") -> str | None:
    """Why one forward cannot do what tree masks do on ``model`` (``cannot``) and what to do ``instead``, read from
    its layers' cache kinds alone (no cache is built); None: every layer lets a tree through."""
    config = model.config.get_text_config(decoder=True)
    types = get_layer_types_and_kwargs(config)[0]
    refusing = sorted({t for t in types if not kind_of(t, config).trees})
    if not refusing:
        return None
    return (f"{type(model).__name__} has {'/'.join(refusing)} layers, which run the fed tokens in order: one forward "
            f"cannot {cannot}. {instead}")


class TargetCache:
    """A model's cache for speculative decoding (batch of one): ``forward`` appends tokens, ``keep`` rolls back to
    a prefix plus chosen positions after it. ``length`` counts the positions held."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        text_config = model.config.get_text_config(decoder=True)
        self.layer_types, kwargs = get_layer_types_and_kwargs(text_config)
        self.kinds = [kind_of(layer_type, text_config) for layer_type in self.layer_types]
        self.windows = [k.get("sliding_window") for k in kwargs]
        self.cache = self._new_cache()
        self.stateful = [i for i, kind in enumerate(self.kinds) if kind.states]
        self.tokens = torch.zeros(1, 0, dtype=torch.long)  # what each held position was fed (a recurrent replay)
        self.positions = torch.zeros(0, dtype=torch.long)  # each held position's position id (window masks)
        self.snapshots: dict[int, dict] = {}  # length -> copies of the recurrent states at that length
        # how many of the newest positions have their recurrent states recorded (a rollback of up to that many runs
        # nothing again), and whether the model records what it is asked to (None: not seen yet)
        self.recorded, self.records = 0, None
        self._history_before: dict[tuple[int, int], int] = {}

    def _new_cache(self) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        cache.activate_past_recording()
        for layer in cache.layers:
            if hasattr(layer, "recurrent_states_history"):  # one list per state (transformers shares one list)
                layer.recurrent_states_history = {s: [] for s in range(layer.number_of_states)}
        return cache

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def supports_trees(self) -> bool:
        """Whether one forward can verify a tree: every layer's kind lets one through (see the module docstring)."""
        return all(kind.trees for kind in self.kinds)

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                allowed: torch.Tensor | None = None, logits_to_keep: int = 0,
                head: torch.nn.Linear | None = None) -> torch.Tensor:
        """Append ``input_ids`` [1, n] and return logits [1, n or logits_to_keep, V].

        ``allowed`` None means plain causal attention (transformers builds the masks). Otherwise ``allowed`` [n, m]
        says which of the last m keys (earlier tree nodes still in the cache, then these n tokens) each new token may
        see; everything before them is visible to all, within each layer's window. Pass ``position_ids`` with it.
        ``head``: logits over these output rows only (a draft vocabulary) instead of the model's own lm_head."""
        n = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(self.length, self.length + n, device=input_ids.device)[None]
        mask = None
        if allowed is not None:
            if not self.supports_trees:
                raise DrafttrainError(self.tree_refusal())
            mask = self._tree_masks(allowed, position_ids[0].cpu(), input_ids.device)
        if self.stateful:
            self._before_forward(n, self.length)
        logits = model_forward(self.model, self.cache, input_ids, position_ids, mask, logits_to_keep, head)
        if self.stateful:
            self._after_forward(n)
        self.tokens = torch.cat([self.tokens, input_ids.cpu()], dim=1)
        self.positions = torch.cat([self.positions, position_ids[0].cpu()])
        return logits

    def tree_refusal(self, cannot: str = "verify a tree's branches side by side",
                     instead: str = "Use a chain (--tree chain)") -> str:
        """Why one forward cannot do what tree masks do on this model (``cannot``), and what to do ``instead``."""
        return tree_refusal(self.model, cannot, instead) or ""

    def keep(self, start: int, keep: list[int]) -> None:
        """Keep, of the positions from ``start`` on, only the offsets ``keep`` (increasing), moved to start,
        start+1, ...: a verified tree's accepted path; a chain's accepted prefix is ``range(n)``."""
        n, held = len(keep), self.length
        chain = keep == list(range(n))
        if not chain:
            if not self.supports_trees:
                raise DrafttrainError(self.tree_refusal())
            self._move(start, keep)
        kept = torch.cat([torch.arange(start), start + torch.as_tensor(keep, dtype=torch.long)])
        self.tokens, self.positions = self.tokens[:, kept], self.positions[kept]
        dropped = held - start - n
        if dropped > 0 and self.stateful and dropped > self.recorded:
            self._restore_and_replay(start + n, held)
        else:
            if dropped > 0 and self.stateful:
                self._rewind_states(dropped)
            self._crop(dropped)
        self.snapshots = {length: s for length, s in self.snapshots.items() if length <= self.length}

    # ------------------------------------------------------------------------------------------ attention layers

    def _move(self, start: int, keep: list[int]) -> None:
        """A tree's accepted nodes moved into place in every attention layer (a layer holding fewer positions
        than were fed, a window, is indexed from its end)."""
        for kind, layer in zip(self.kinds, self.cache.layers):
            if not kind.positions or not getattr(layer, "is_initialized", False):
                continue
            offset = layer.keys.shape[-2] - (self.length - start)  # where position ``start`` lies in this layer
            idx = torch.tensor(keep, device=layer.keys.device) + offset
            layer.keys[..., offset: offset + len(keep), :] = layer.keys[..., idx, :]
            layer.values[..., offset: offset + len(keep), :] = layer.values[..., idx, :]

    def _crop(self, dropped: int, length: int | None = None) -> None:
        """Drop the last ``dropped`` positions from every layer, then trim what past-state recording kept to what
        the next forward reads plus ``RECORDED_MARGIN`` positions (transformers' own crop trims to exactly what the
        next forward reads, so a second rollback before a forward, as at the end of a generate call, would lose one
        position the window still needs)."""
        for kind, layer in zip(self.kinds, self.cache.layers):
            if kind.states:
                _crop_conv(layer, dropped)
                if hasattr(layer, "cumulative_length_linear"):  # the token count a model reads its positions from
                    layer.cumulative_length_linear.fill_(self.length if length is None else length)
            if not kind.positions or not getattr(layer, "is_initialized", False):
                continue
            if dropped:
                layer.keys, layer.values = layer.keys[..., :-dropped, :], layer.values[..., :-dropped, :]
            if kind.windowed:
                layer.cumulative_length -= dropped
                kept = layer.sliding_window - 1 + RECORDED_MARGIN
                layer.keys, layer.values = layer.keys[..., -kept:, :], layer.values[..., -kept:, :]

    def _tree_masks(self, allowed: torch.Tensor, query_positions: torch.Tensor, device) -> torch.Tensor | dict:
        """The ancestor mask in each attention layer type's own shape: one 4D mask, or a mask per layer type."""
        masks = {}
        attention = [t for t, kind in zip(self.layer_types, self.kinds) if kind.positions]
        for layer_type in dict.fromkeys(attention):
            index = self.layer_types.index(layer_type)
            kv_length, kv_offset = self.cache.get_mask_sizes(len(query_positions), index)
            masks[layer_type] = _window_tree_mask(allowed, self.positions, query_positions, kv_length, kv_offset,
                                                  self.kinds[index], self.windows[index], self.model.dtype, device)
        if len(masks) == 1 and len(set(self.layer_types)) == 1:
            return next(iter(masks.values()))
        return masks

    # ------------------------------------------------------------------------------------------ recurrent layers

    def _before_forward(self, n: int, length: int) -> None:
        """Ask for a recorded state per token when the forward of ``n`` tokens after ``length`` held ones is short
        enough; copy the states when it will not be recorded (a rollback into it is then a restore and a replay)."""
        recording = n <= RECORDED_MARGIN and self.records is not False
        for i in self.stateful:
            self.cache.layers[i].recurrent_states_to_keep = n if recording else 0
        if (not recording or self.records is None) and length not in self.snapshots:
            self.snapshots[length] = self._copy_states()
        self._history_before = self._history_lengths()

    def _after_forward(self, n: int) -> None:
        """How many of the newest positions now have recorded states. transformers keeps, per forward, the state
        before it and then the states it was asked to record: a forward of n tokens that recorded n is whole; one
        that recorded fewer (a long forward, or a model that ignores the request) leaves only those it computed."""
        lengths = self._history_lengths()
        if not lengths:  # no recurrent state (short convolutions only): their inputs are kept by the crop
            self.recorded = RECORDED_MARGIN
            return
        grown = min(after - self._history_before.get(key, 0) for key, after in lengths.items())
        whole = grown == n
        if 1 < n <= RECORDED_MARGIN and self.records is None:
            self.records = whole
        self.recorded = min(self.recorded + n, RECORDED_MARGIN) if whole else max(grown - 1, 0)
        self._trim_history(self.recorded)

    def _history_lengths(self) -> dict[tuple[int, int], int]:
        """The number of recorded states of each initialised recurrent state (-1: its layer records none)."""
        lengths = {}
        for i in self.stateful:
            layer = self.cache.layers[i]
            history = getattr(layer, "recurrent_states_history", None)
            for s, initialized in layer.is_recurrent_states_initialized.items():
                if initialized:
                    lengths[i, s] = -1 if history is None else len(history[s])
        return lengths

    def _trim_history(self, keep: int) -> None:
        for i in self.stateful:
            for history in getattr(self.cache.layers[i], "recurrent_states_history", {}).values():
                del history[: max(len(history) - keep, 0)]

    def _rewind_states(self, dropped: int) -> None:
        """Each recurrent state back to the one recorded before the first dropped token."""
        for i in self.stateful:
            layer = self.cache.layers[i]
            for s, history in getattr(layer, "recurrent_states_history", {}).items():
                if layer.is_recurrent_states_initialized[s]:
                    layer.recurrent_states[s] = history[-dropped]
                    del history[-dropped:]
        self.recorded -= dropped

    def _copy_states(self) -> dict:
        copies = {}
        for i in self.stateful:
            layer = self.cache.layers[i]
            copies[i] = {field: {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                 for k, v in getattr(layer, field).items()} for field in _STATE_FIELDS}
        return copies

    def _restore_and_replay(self, length: int, held: int) -> None:
        """The cache at ``length`` of the ``held`` positions: back to the newest copy of the states at or before
        it, every attention layer cropped to the same point, then the kept tokens after it fed again."""
        base = max([s for s in self.snapshots if s <= length], default=0)  # 0: a new cache
        tokens = self.tokens
        if base == 0:
            self.cache = self._new_cache()
        else:
            self._crop(held - base, length=base)
            for i, fields in self.snapshots[base].items():
                for field, values in fields.items():
                    setattr(self.cache.layers[i], field, {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                                          for k, v in values.items()})
        self.snapshots = {base: self.snapshots[base]}
        self._trim_history(0)
        self.recorded = 0
        if length > base:
            device = next(self.model.parameters()).device
            ids = tokens[:, base:length].to(device)
            positions = torch.arange(base, length, device=device)[None]
            self._before_forward(length - base, base)
            model_forward(self.model, self.cache, ids, positions, None, 1, None)
            self._after_forward(length - base)
        self._crop(0)


def _crop_conv(layer, dropped: int) -> None:
    """A convolution's recorded inputs: the last ``dropped`` dropped, the rest trimmed to its reach plus the margin."""
    for i, initialized in layer.is_conv_states_initialized.items():
        if not initialized:
            continue
        states = layer.conv_states[i][..., :-dropped] if dropped else layer.conv_states[i]
        layer.conv_states[i] = states[..., -(layer.conv_kernel_size[i] + RECORDED_MARGIN):]


def _window_tree_mask(allowed: torch.Tensor, held_positions: torch.Tensor, query_positions: torch.Tensor,
                      kv_length: int, kv_offset: int, kind: CacheKind, window: int | None, dtype,
                      device) -> torch.Tensor:
    """A 4D additive mask [1, 1, n, kv_length] over the keys a layer returns (held positions from ``kv_offset``,
    then the n new ones): a key is seen when it is before the tree's last m keys or an allowed one of them, and
    within the layer's window (sliding: fewer than ``window`` positions back; chunked: the same chunk of
    ``window``), at the position ids the nodes have (their depths), so each branch sees what its chain would."""
    n, m = allowed.shape
    keys = torch.cat([held_positions, query_positions])[kv_offset: kv_offset + kv_length]
    slots = torch.arange(kv_offset, kv_offset + kv_length)
    first_tree_slot = len(held_positions) + n - m
    seen = torch.ones(n, kv_length, dtype=torch.bool)
    in_tree = slots >= first_tree_slot
    seen[:, in_tree] = allowed.cpu()[:, slots[in_tree] - first_tree_slot]
    seen &= kind.sees(query_positions[:, None], keys[None], window)
    mask = torch.zeros(n, kv_length, dtype=dtype)
    mask.masked_fill_(~seen, torch.finfo(dtype).min)
    return mask[None, None].to(device)
