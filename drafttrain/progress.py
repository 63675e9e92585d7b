"""Progress of a long stage: a tqdm bar on a terminal; elsewhere (a CI log, ``nohup``, a notebook cell) the same bar
written as a one-line progress record through the ``drafttrain.progress`` logger at most every ``every_s`` seconds,
so a long stage is never silent and a log file holds no carriage-return clutter."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterable

from tqdm.auto import tqdm

# The logger of the progress records (this module's own name): the trainer and every long stage write them, and the
# quickstart shows them on a console that is not a terminal.
PROGRESS_LOGGER = __name__
PROGRESS_EVERY_S = 30.0  # a progress record where no bar can be drawn, at most this often
RECORD_FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit} ({percentage:.0f}%) elapsed={elapsed} eta={remaining} {rate_fmt}"

progress_log = logging.getLogger(PROGRESS_LOGGER)


class _Records:
    """A file for tqdm that turns its refreshes into log records, at most one every ``every_s`` seconds (a refresh
    forced by a postfix or a burst of updates does not add one) and the last one (100%) always."""

    def __init__(self, every_s: float):
        self.every_s, self.last = every_s, -math.inf

    def write(self, text: str) -> None:
        line = text.strip("\r\n ")
        now = time.monotonic()
        if line and (now - self.last >= self.every_s or "(100%)" in line):
            self.last = now
            progress_log.info("%s", line)

    def flush(self) -> None:
        pass


def on_terminal() -> bool:
    return sys.stderr.isatty()


def progress_bar(iterable: Iterable | None = None, desc: str = "", unit: str = "it", *, total: int | None = None,
                 enabled: bool = True, every_s: float = PROGRESS_EVERY_S, **kwargs) -> tqdm:
    """``tqdm(iterable, ...)`` on a terminal; progress records every ``every_s`` seconds elsewhere."""
    if on_terminal():
        return tqdm(iterable, desc=desc, unit=unit, total=total, disable=not enabled, leave=False, **kwargs)
    # smoothing 0: the rate and ETA over the whole stage (work that finishes in batches fools a moving average)
    return tqdm(iterable, desc=desc, unit=unit, total=total, disable=not enabled, file=_Records(every_s),
                mininterval=every_s, smoothing=0, bar_format=RECORD_FORMAT, ascii=True, **kwargs)
