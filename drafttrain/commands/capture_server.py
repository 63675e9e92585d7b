"""``drafttrain capture-server RECIPE.yaml [key.sub=value ...] [--port P] [--host H]``

One capture server for a recipe, in the foreground until Ctrl-C: vLLM (from ``capture.python``) serving the
recipe's target with the parallelism its ``capture`` section gives, writing the hidden states the recipe's draft
kind needs into ``capture.folder``. Start one on each node that serves the target, and list their URLs in
``capture.urls`` of the recipe the trainers run.
"""

from __future__ import annotations

import argparse
import time

from drafttrain import DrafttrainError
from drafttrain.config import load_recipe
from drafttrain.drafts import drafter_for
from drafttrain.drafts.continuation import resolved_section
from drafttrain.sources.choose import capture_urls
from drafttrain.targets.partial import load_shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML (its target, draft and capture sections)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="recipe overrides (YAML values)")
    parser.add_argument("--port", type=int, help="the server's port (default: capture.port)")
    parser.add_argument("--host", default="0.0.0.0", help="the address it listens on (default: every interface, so "
                                                          "trainers on other nodes reach it)")


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + ([f"capture.port={args.port}"] if args.port else [])
    recipe = load_recipe(args.recipe, overrides + ["capture.servers=1", "capture.urls=[]"])
    if recipe.draft is None or recipe.capture.python is None:
        raise DrafttrainError("capture-server needs the recipe's draft section (which layers to capture) and "
                              "capture.python (a Python with vLLM installed)")
    recipe.capture.server_args = [*recipe.capture.server_args, "--host", args.host]
    section, shape = resolved_section(recipe.draft), load_shape(recipe.target)
    needs = drafter_for(section).target_needs(section, shape)
    with capture_urls(recipe, needs, shape.num_layers, start=True) as urls:
        print(f"capture server ready at {urls[0]} (this machine's address on port {recipe.capture.port}); "
              "Ctrl-C stops it", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0
