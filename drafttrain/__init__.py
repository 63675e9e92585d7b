"""drafttrain: train speculative-decoding drafters and measure them honestly."""

__version__ = "0.1.0"


class DrafttrainError(Exception):
    """A user-facing error: the CLI prints its message (which names the cause) without a traceback."""

# The logger of periodic one-line progress records, for outputs where no progress bar can be drawn (a log file,
# CI, nohup, a notebook): the trainer writes them, the quickstart shows them on a console that is not a terminal.
PROGRESS_LOGGER = "drafttrain.progress"
