"""The capture servers a recipe needs when capture engines run its target (``capture.engine: vllm``), read from
config files alone; ``drafttrain plan`` prints them beside the training processes' memory.

Per GPU of one server (:func:`capture_plan`), within the share vLLM may take of it
(``capture.gpu_memory_utilization``): the runtime, its share of the target's weights at the server's parallelism
(:func:`server_weights`; a target published quantized counted as published, :data:`QUANTIZED_BITS`), the prefill
activations and the KV cache of one row (the captured states included), which vLLM needs before it starts; what is
left is KV cache for rows at once. A server that needs more GPUs than a node has is refused. For a stream: the
window of files on the capture folder's disk (``capture.window`` micro-batches of every process), and the tokens
per second all trainers consume against what all servers deliver, refused when the servers cannot keep up.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math

import torch

from drafttrain.config import Recipe
from drafttrain.sources.choose import served_length
from drafttrain.sources.engine import engine_layer_ids
from drafttrain.targets.hidden import decoder_layers
from drafttrain.targets.loading import _DTYPES, Target
from drafttrain.targets.outputs import TargetNeeds
from drafttrain.training.cluster import Cluster
from drafttrain.training.sizes import CUDA_CONTEXT, _cache_bytes, _on_gpu, _size, clearly_exceeds, within

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
        return within(self.total, self.budget)

    @property
    def window_fits(self) -> bool:
        return within(self.window_bytes, self.disk_free)

    @property
    def window_clearly_too_big(self) -> bool:
        return clearly_exceeds(self.window_bytes, self.disk_free)

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


def _prefill_bytes(tokens: int, target: Target) -> int:
    """A capture server's prefill over ``tokens`` tokens, through vLLM's fused attention and experts kernels: one
    layer's working set (attention and MLP inputs and outputs) plus the residual stream, in the target's dtype."""
    config = target.model.config
    width = 4 * target.hidden_size + 3 * int(getattr(config, "intermediate_size", 4 * target.hidden_size))
    return tokens * width * target.model.dtype.itemsize


def capture_plan(recipe: Recipe, target: Target, needs: TargetNeeds, cluster: Cluster, tokens: int,
                 capture_rate: float | None = None, train_rate: float | None = None,
                 window_disk_free: int | None = None) -> CapturePlan:
    """The capture side of ``recipe``: its servers on nodes like the trainers' (``cluster.gpus`` GPUs of
    ``cluster.gpu_memory`` each), the ``cluster.world`` training processes they feed. ``window_disk_free``: the free
    space on the capture folder's disk, where a stream keeps its window of files (None: unknown)."""
    settings, on_gpu = recipe.capture, _on_gpu(recipe)
    stream = recipe.training.hidden_states == "stream"
    dtype = target.model.dtype if settings.dtype == "auto" else _DTYPES[settings.dtype]
    length, taps = served_length(recipe), len(engine_layer_ids(needs, target.num_layers))
    captured = taps * target.hidden_size * dtype.itemsize  # one token's states in a captured file
    row_kv = _cache_bytes(target, length, dtype, settings.tensor_parallel_size,
                          settings.pipeline_parallel_size) + length * captured
    weights, label, notes = server_weights(target.model, settings, dtype)
    memory = {"runtime (CUDA context)": CUDA_CONTEXT if on_gpu else 0, label: weights,
              "prefill activations, 1 row": _prefill_bytes(length, target) // settings.tensor_parallel_size,
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
        result.disk_free = window_disk_free
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
