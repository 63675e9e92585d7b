"""``drafttrain plan RECIPE.yaml [key.sub=value ...] [--gpus N --gpu-memory GiB --nodes M]``

Reads config files only (the target's config.json, the recipe, the DeepSpeed JSON) and prints, in seconds, what the
run needs per process, the offline cache on disk, the regeneration work, the capture servers (their memory per GPU,
a stream's window of files, the tokens/s they must deliver) and whether it fits (drafttrain.training.plan).
``train`` and ``prepare`` make the same check first.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from drafttrain import DrafttrainError
from drafttrain.config import load_recipe
from drafttrain.targets.loading import models_from_configs
from drafttrain.training.cluster import Cluster, read_hostfile
from drafttrain.training.plan import plan
from drafttrain.training.sizes import GIB


def positive_int(text: str) -> int:
    """An argparse type: a count that must be given as a whole number above 0 (0 is not "unknown")."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0, got {text!r}")
    return value


def positive_number(text: str) -> float:
    """An argparse type: a size above 0 and finite (nan, inf, 0 and negatives are refused, not read as unknown)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="recipe overrides (YAML values)")
    parser.add_argument("--stage", choices=("train", "prepare"), default="train")
    parser.add_argument("--gpus", type=positive_int, help="GPUs (processes) per node (default 1, or the hostfile's slots)")
    parser.add_argument("--nodes", type=positive_int, help="nodes (default 1, or the hostfile's hosts)")
    parser.add_argument("--hostfile", help="a DeepSpeed hostfile: its hosts must resolve; it gives --nodes and --gpus")
    parser.add_argument("--gpu-memory", type=positive_number, metavar="GiB", help="memory per GPU (default: this GPU's, if any)")
    parser.add_argument("--disk", type=positive_number, metavar="GiB",
                        help="free disk for the offline cache, or a stream's window of files (default: the free space "
                             "of the output folder, or of capture.folder)")
    parser.add_argument("--regen-throughput", type=positive_number, metavar="TOKENS_PER_S",
                        help="the regeneration server's throughput, for the expected regeneration time")
    parser.add_argument("--capture-throughput", type=positive_number, metavar="TOKENS_PER_S",
                        help="one capture server's prefill tokens/s (capture.engine vllm): the capture time, and "
                             "whether a stream's servers keep up")
    parser.add_argument("--train-throughput", type=positive_number, metavar="TOKENS_PER_S",
                        help="the tokens/s one training process consumes: a stream's servers must deliver that "
                             "times the processes")
    parser.add_argument("--target-config", metavar="CONFIG.json",
                        help="the target's config.json, instead of fetching it for the recipe's target")
    parser.add_argument("--model-config", action="append", default=[], metavar="NAME=CONFIG.json",
                        help="a model the recipe loads besides the target (a distilled draft's student) that is not "
                             "on this machine, by its config.json (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    given = [flag for flag, value in (("--capture-throughput", args.capture_throughput),
                                      ("--train-throughput", args.train_throughput)) if value is not None]
    if given and recipe.capture.engine == "hf":
        raise DrafttrainError(f"{' and '.join(given)}: for a recipe whose capture servers run the target "
                              "(capture.engine vllm); this one's target runs in the training processes")
    hosts = read_hostfile(args.hostfile) if args.hostfile else {"this machine": 1}
    memory = int(args.gpu_memory * GIB) if args.gpu_memory else None
    if memory is None and recipe.target.device.startswith("cuda") and torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(0).total_memory
    cluster = Cluster(gpus=args.gpus or next(iter(hosts.values())), nodes=args.nodes or len(hosts), gpu_memory=memory,
                      disk_free=int(args.disk * GIB) if args.disk else None)
    with models_from_configs(_model_configs(args.model_config)):
        result = plan(recipe, cluster, stage=args.stage, config_path=args.target_config,
                      regen_throughput=args.regen_throughput, capture_throughput=args.capture_throughput,
                      train_throughput=args.train_throughput)
    print(json.dumps(result.as_dict(), indent=1) if args.json else result.render())
    return 0 if result.fits else 1


def _model_configs(pairs: list[str]) -> dict[str, str]:
    configs = {}
    for pair in pairs:
        name, equals, path = pair.rpartition("=")
        if not equals or not name or not Path(path).is_file():
            raise DrafttrainError(f"--model-config {pair}: give NAME=CONFIG.json, the model's name as the recipe "
                                  "writes it and an existing config.json")
        configs[name] = path
    return configs
