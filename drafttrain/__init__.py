"""drafttrain: train speculative-decoding drafters and measure them honestly."""

__version__ = "0.1.0"


class DrafttrainError(Exception):
    """A user-facing error: the CLI prints its message (which names the cause) without a traceback."""
