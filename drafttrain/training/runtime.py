"""The Accelerator for a recipe: mixed precision, gradient accumulation and DeepSpeed, on GPUs or CPUs.

DeepSpeed on CPU needs two things accelerate does not do by itself:

* an explicit ``gloo`` backend. Without it accelerate (1.15) finds no GPU backend, initialises DeepSpeed's
  process group anyway but records ``num_processes = 1``, so it computes ``train_batch_size`` for one process
  and DeepSpeed's batch assertion fails under 2 processes ("... 2 != 2 * 1 * 2").
* ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*`` when run without a launcher (one process), since
  DeepSpeed otherwise falls back to MPI discovery. GPUs need these too: accelerate initialises DeepSpeed only where
  ``LOCAL_RANK`` is set.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

from drafttrain import DrafttrainError
from drafttrain.config import TrainingConfig


def uses_deepspeed(training: TrainingConfig) -> bool:
    return training.deepspeed is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"


def build_accelerator(training: TrainingConfig):
    config = read_deepspeed_config(training.deepspeed) if training.deepspeed else None
    # ZeRO-3: transformers' from_pretrained partitions the target while it loads (zero.Init) once this exists
    stage3 = config is not None and int(config["zero_optimization"].get("stage", 0)) == 3
    plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=stage3) if config else None
    handlers = []
    if uses_deepspeed(training):
        # accelerate makes DeepSpeed's process group only where LOCAL_RANK is set, but takes the plugin anyway: one
        # process started plainly or by `accelerate launch` without a DeepSpeed config then failed at its first
        # barrier ("Default process group has not been initialized"; seen on an H100)
        _single_process_env_if_unlaunched()
        if not torch.cuda.is_available():
            handlers.append(InitProcessGroupKwargs(backend="gloo"))
    accelerator = Accelerator(
        mixed_precision=training.mixed_precision,
        gradient_accumulation_steps=training.gradient_accumulation,
        deepspeed_plugin=plugin,
        kwargs_handlers=handlers,
        # The schedule is built in optimizer steps; accelerate would otherwise step it once per process.
        step_scheduler_with_optimizer=False,
    )
    if accelerator.state.deepspeed_plugin is not None:
        fill_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, training, accelerator.num_processes)
    return accelerator


def zero_stage_of(accelerator) -> int:
    """The ZeRO stage a running accelerator uses (from the recipe's JSON or accelerate's own config)."""
    plugin = accelerator.state.deepspeed_plugin
    return int(plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0)) if plugin is not None else 0


def configured_zero_stage(training: TrainingConfig) -> int:
    """The ZeRO stage the recipe's DeepSpeed JSON asks for (0 without one), known before anything starts."""
    if not training.deepspeed:
        return 0
    return int(read_deepspeed_config(training.deepspeed)["zero_optimization"].get("stage", 0))


def shard_frozen(model: torch.nn.Module, accelerator):
    """ZeRO-3 for a frozen model (the target): a DeepSpeed engine with no optimizer, made from the run's stage-3
    config, so its weights stay partitioned over the processes and each layer's are gathered for its forward
    only (the pattern TRL uses for reference and teacher models). A model loaded under zero.Init (see
    ``build_accelerator``) is partitioned already; one built whole is partitioned here."""
    import deepspeed  # heavy to import: only under a DeepSpeed config

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine.eval()


def gathered(parameters, enabled: bool):
    """The whole of ZeRO-3-partitioned ``parameters`` on every process inside the block (collective: every rank
    enters it); nothing to do otherwise."""
    if not enabled:
        return contextlib.nullcontext()
    import deepspeed  # heavy to import: only under a DeepSpeed config

    return deepspeed.zero.GatheredParameters(list(parameters), modifier_rank=None)


def local_part(param: torch.Tensor, rank: int | None = None) -> torch.Tensor:
    """This process's share of a parameter: the elements of its ZeRO-3 partition, or the whole tensor.

    ZeRO-3 pads every parameter to a multiple of the world size, so the last ranks' partitions end in padding that
    DeepSpeed allocates with ``torch.empty`` and never writes: uninitialised memory, sometimes NaN. It is cut off
    here (a CI run refused finite weights as "not finite" by reading it). ``rank``: this process's place in the
    parameter's partition group (default: asked of torch.distributed)."""
    part = getattr(param, "ds_tensor", None)
    if part is None:
        return param
    if rank is None:
        rank = torch.distributed.get_rank(group=getattr(param, "ds_process_group", None))
    size = part.numel()
    return part.narrow(0, 0, max(0, min(size, param.ds_numel - rank * size)))


def process_state():
    """This process's place in a launch (accelerate's PartialState): one process without a launcher. On CPU the
    gloo backend is named, or accelerate would count one process per launch (see the module doc)."""
    if "LOCAL_RANK" in os.environ and not torch.cuda.is_available():
        return PartialState(backend="gloo")
    return PartialState()


def end_processes() -> None:
    """Leave a launch's process group before a launched process exits: its communication threads, still running when
    the interpreter shuts down, can abort a process whose work is done (SIGABRT, "terminate called without an active
    exception"), which the launcher then reports as a failed run. A single process keeps its group (a library caller,
    or a test, may train again in it)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and torch.distributed.get_world_size() > 1:
        torch.distributed.destroy_process_group()


def read_deepspeed_config(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise DrafttrainError(f"training.deepspeed: DeepSpeed config not found: {file}")
    try:
        config = json.loads(file.read_text())
    except ValueError as err:
        raise DrafttrainError(f"training.deepspeed: {file} is not valid JSON: {err}") from None
    if "zero_optimization" not in config:
        raise DrafttrainError(f"training.deepspeed: {file} has no zero_optimization section")
    return config


def fill_deepspeed_config(config: dict[str, Any], training: TrainingConfig, world_size: int) -> None:
    """Fill the config's "auto" values from the recipe, and refuse settings that contradict it."""
    stage = int(config.get("zero_optimization", {}).get("stage", 0))
    if stage == 3:  # a checkpoint holds the whole draft, whatever the number of processes
        config["zero_optimization"].setdefault("stage3_gather_16bit_weights_on_model_save", True)
    for half in ("bf16", "fp16"):  # known now: the frozen target's engine is made before accelerate fills them
        if config.get(half, {}).get("enabled") == "auto":
            config[half]["enabled"] = training.mixed_precision == half
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise DrafttrainError(
                f"the DeepSpeed config has an {section!r} section; the recipe's training section defines the "
                "optimizer and schedule (AdamW, training.scheduler): remove it from the JSON"
            )
    wanted = {
        "train_micro_batch_size_per_gpu": training.batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation,
        "gradient_clipping": training.max_grad_norm,
        "train_batch_size": training.batch_size * training.gradient_accumulation * world_size,
    }
    for key, value in wanted.items():
        current = config.get(key, "auto")
        if current == "auto":
            config[key] = value
        elif float(current) != float(value):
            raise DrafttrainError(
                f"the DeepSpeed config sets {key}={current} but the recipe implies {value}: set it to \"auto\""
            )


def _single_process_env_if_unlaunched() -> None:
    if "LOCAL_RANK" in os.environ:
        return  # started by accelerate launch / torchrun / deepspeed
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
