import logging
import os
import sys

from drafttrain.commands import main


def leave(code: int) -> None:
    """Exit. A launched process (one of several) whose work is done and written leaves without the interpreter's
    teardown: there, the communication threads of its finished process group (gloo, DeepSpeed) can still abort it
    (SIGABRT, "terminate called without an active exception"), which the launcher reports as a failed run."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


if __name__ == "__main__":
    leave(main())
