"""Progress of a long stage: a tqdm bar on a terminal; elsewhere (a CI log, ``nohup``, a notebook cell) the same bar
written as a one-line progress record through the ``drafttrain.progress`` logger at most every ``every_s`` seconds,
so a long stage is never silent and a log file holds no carriage-return clutter."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable

from tqdm.auto import tqdm

# The logger of the progress records (this module's own name): the trainer and every long stage write them, and the
# quickstart shows them on a console that is not a terminal.
PROGRESS_LOGGER = __name__
PROGRESS_EVERY_S = 30.0  # a progress record where no bar can be drawn, at most this often
RECORD_FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit} ({percentage:.0f}%) elapsed={elapsed} eta={remaining} {rate_fmt}"

progress_log = logging.getLogger(PROGRESS_LOGGER)


class _Records:
    """A file for tqdm that turns each refresh into one log record."""

    def write(self, text: str) -> None:
        line = text.strip("\r\n ")
        if line:
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
    return tqdm(iterable, desc=desc, unit=unit, total=total, disable=not enabled, file=_Records(),
                mininterval=every_s, bar_format=RECORD_FORMAT, ascii=True, **kwargs)
