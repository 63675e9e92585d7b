"""Which source computes a run's target outputs, chosen once from the recipe (``training.hidden_states`` and the
``capture`` section): the HF forward, the offline cache, or capture servers (started here from ``capture.python``
by the first process of a launch on each node, or running already at ``capture.urls``). Nothing else asks which."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from drafttrain import DrafttrainError
from drafttrain.config import Recipe
from drafttrain.data.tokenize import split_fingerprint
from drafttrain.engines.capture import CaptureClient, Parallelism, capture_servers, served_model
from drafttrain.engines.server import HEALTH_POLL_S, ready
from drafttrain.runfolder import RunFolder
from drafttrain.sources.base import TargetSource
from drafttrain.sources.cache import FeatureCache
from drafttrain.sources.engine import EngineSource, engine_layer_ids
from drafttrain.sources.hf import HFForward
from drafttrain.targets import Target, load_target
from drafttrain.targets.loading import resolve_model_dir
from drafttrain.targets.outputs import TargetNeeds
from drafttrain.targets.partial import load_head, load_shape

log = logging.getLogger(__name__)


def capture_folder(recipe: Recipe) -> Path:
    """Where the capture servers write and drafttrain reads: capture.folder, else ``capture/`` in the run."""
    folder = recipe.capture.folder
    return Path(folder).expanduser() if folder else RunFolder.of(recipe.output_dir).root / "capture"


def served_length(recipe: Recipe) -> int:
    """The longest request a capture server started here takes (its --max-model-len): a row and one token more."""
    return recipe.data.max_length + 1 if recipe.data is not None else 4096


@contextlib.contextmanager
def capture_urls(recipe: Recipe, needs: TargetNeeds, num_layers: int, start: bool) -> Iterator[list[str]]:
    """The URLs of the run's capture servers, each answering: the recipe's, or ``capture.servers`` started here
    when ``start`` (the first process of a launch; the others wait for them to answer)."""
    settings = recipe.capture
    if settings.urls:
        _wait_until_ready(settings.urls, settings.startup_timeout_s)
        yield list(settings.urls)
        return
    if not start:
        urls = [f"http://127.0.0.1:{settings.port + i}" for i in range(settings.servers)]
        _wait_until_ready(urls, settings.startup_timeout_s)
        yield urls
        return
    run = RunFolder.of(recipe.output_dir)
    dtype = recipe.target.dtype if settings.dtype == "auto" else settings.dtype
    max_len = served_length(recipe)
    parallelism = Parallelism(settings.tensor_parallel_size, settings.pipeline_parallel_size,
                              settings.data_parallel_size, settings.expert_parallel)
    layer_ids = engine_layer_ids(needs, num_layers, prenorm=keeps_prenorm(recipe))
    with capture_servers(settings.python, resolve_model_dir(recipe.target.model), layer_ids,
                         capture_folder(recipe), servers=settings.servers, parallelism=parallelism, dtype=dtype,
                         port=settings.port, max_model_len=max_len, memory_fraction=settings.gpu_memory_utilization,
                         log_dir=run.root / "logs", startup_timeout_s=settings.startup_timeout_s,
                         extra_args=settings.server_args) as urls:
        yield urls


def _wait_until_ready(urls: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while not ready(url):
            if time.monotonic() > deadline:
                raise DrafttrainError(f"the capture server {url} did not answer in {timeout_s:.0f} s: start it with "
                                      "`drafttrain capture-server RECIPE` (or give capture.python to start it here)")
            time.sleep(HEALTH_POLL_S)


def keeps_prenorm(recipe: Recipe) -> bool:
    """Whether the run's sources give the final state before the norm too: the last slot of speculators' layout."""
    return recipe.training.hidden_states == "offline" and recipe.training.written_layout == "speculators"


@contextlib.contextmanager
def engine_source(recipe: Recipe, target: Target, needs: TargetNeeds, dataset, *, rank: int, start: bool,
                  window: int, cache_argmax: bool = False) -> Iterator[EngineSource]:
    """A source fed by the run's capture servers, writing into this process's own folder."""
    with capture_urls(recipe, needs, target.num_layers, start) as urls:
        client = CaptureClient(urls, served_model(urls[0]), max_in_flight=recipe.capture.max_in_flight)
        source = EngineSource(target, needs, dataset, client, capture_folder(recipe) / f"rank{rank}", window,
                              cache_argmax=cache_argmax, prenorm=keeps_prenorm(recipe))
        try:
            yield source
        finally:
            source.close()


def engine_runs_target(recipe: Recipe) -> bool:
    """Whether the target's layers run in capture engines (this process then needs only the target's head)."""
    return recipe.capture.engine != "hf"


@contextlib.contextmanager
def cache_sources(recipe: Recipe, target: Target, needs: TargetNeeds, splits: dict[str, object], *, rank: int = 0,
                  start: bool = True, cache_argmax: bool = False) -> Iterator[dict[str, TargetSource]]:
    """What computes the offline cache's rows of each split (``prepare``): the HF forward here, or the capture servers
    (started once for every split) with ``capture.max_in_flight`` rows at them at once. Only the train split is
    written in speculators' layout (with the final state before the norm) when the recipe asks for it."""
    if not engine_runs_target(recipe):
        yield {name: HFForward(target, needs, rows, cache_argmax=cache_argmax,
                               prenorm=keeps_prenorm(recipe) and name == "train") for name, rows in splits.items()}
        return
    with capture_urls(recipe, needs, target.num_layers, start) as urls:
        client = CaptureClient(urls, served_model(urls[0]), max_in_flight=recipe.capture.max_in_flight)
        folder = capture_folder(recipe) / f"rank{rank}"
        sources = {name: EngineSource(target, needs, rows, client, folder / name, recipe.capture.max_in_flight,
                                      cache_argmax=cache_argmax, prenorm=keeps_prenorm(recipe) and name == "train")
                   for name, rows in splits.items()}
        try:
            yield sources
        finally:
            for source in sources.values():
                source.close()


def process_target(recipe: Recipe, keep_last: int = 0) -> Target:
    """The target as this process needs it: whole, or only its head (and its last ``keep_last`` layers, a draft's
    start) when capture engines run its layers."""
    if not engine_runs_target(recipe):
        return load_target(recipe.target)
    layers = load_shape(recipe.target).num_layers
    return load_head(recipe.target, keep=tuple(range(layers - keep_last, layers)))


@dataclasses.dataclass
class HeldOut:
    """The held-out rows a checkpoint is measured on (the validation split), and where their target outputs come from
    (the run's own kind of source: its HF forward, the validation split's offline cache, or its capture engines)."""

    rows: object
    source: TargetSource


@contextlib.contextmanager
def training_sources(recipe: Recipe, target: Target, needs: TargetNeeds, dataset, split_fingerprint: str,
                     held_out: object | None = None, held_out_needs: TargetNeeds | None = None
                     ) -> Iterator[tuple[TargetSource, HeldOut | None]]:
    """The sources a training process takes its target outputs from, for ``training.hidden_states``: the HF forward
    (online), the offline cache prepare wrote, or capture engines streaming them (a window of ``capture.window``
    micro-batches ahead; servers started from ``capture.python`` by the first process of each node); and the same
    kind of source for the ``held_out`` rows (None: none, or an offline run whose prepare cached none)."""
    mode, run = recipe.training.hidden_states, RunFolder.of(recipe.output_dir)
    held_needs = held_out_needs or needs
    if mode == "online":
        yield HFForward(target, needs), _held(held_out, lambda: HFForward(target, held_needs))
    elif mode == "offline":
        held = _held_out_cache(run, target, needs, held_out) if held_needs == needs and caches_held_out(needs) else \
            _held(held_out, lambda: HFForward(target, held_needs))
        yield FeatureCache(run.features, target, needs, split_fingerprint), held
    else:
        with _streams(recipe, target, (needs, held_needs), dataset, held_out) as sources:
            yield sources


def caches_held_out(needs: TargetNeeds) -> bool:
    """Whether prepare caches the validation split for held-out accuracy: not for a teacher's top-k cache, since the
    held-out measures (β) read whole distributions. An offline run holds the target: where the held-out rows need
    what the cache lacks, its HF forward gives them."""
    return needs.logits_top_k is None


def _held(rows, make) -> HeldOut | None:
    return None if rows is None or not len(rows) else HeldOut(rows, make())


def _held_out_cache(run: RunFolder, target: Target, needs: TargetNeeds, rows) -> HeldOut | None:
    """The validation split's offline cache, when prepare wrote one for these rows."""
    if rows is None or not len(rows) or not (run.held_out_features / "index.json").is_file():
        if rows is not None and len(rows):
            log.warning("no offline cache of the validation split in %s (prepared before it was written): "
                        "checkpoints get no held-out accuracy; rerun `drafttrain prepare`", run.held_out_features)
        return None
    return HeldOut(rows, FeatureCache(run.held_out_features, target, needs, split_fingerprint(rows)))


@contextlib.contextmanager
def _streams(recipe: Recipe, target: Target, needs: tuple[TargetNeeds, TargetNeeds], dataset, held_out
             ) -> Iterator[tuple[TargetSource, HeldOut | None]]:
    """The training rows and the held-out ones from the run's capture servers, each process in its own folders."""
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    window = recipe.capture.window * recipe.training.batch_size
    with capture_urls(recipe, needs[0], target.num_layers, start=local == 0) as urls:
        client = CaptureClient(urls, served_model(urls[0]), max_in_flight=recipe.capture.max_in_flight)
        folder = capture_folder(recipe) / f"rank{rank}"
        train = EngineSource(target, needs[0], dataset, client, folder, window, prenorm=keeps_prenorm(recipe))
        held = _held(held_out, lambda: EngineSource(target, needs[1], held_out, client, folder / "held-out", window))
        try:
            yield train, held
        finally:
            train.close()
            if held is not None:
                held.source.close()
