"""Run speculators' CLI on a CPU-only machine (speculators 0.9.0), without editing the installed package.

Three runtime patches, each a one-line change upstream (see ../shared/notes/reference_trainers_on_cpu.md):
  1. trainer.get_local_rank -> "cpu": the rank is only used in ``.to(local_rank)``, which means an accelerator.
  2. Trainer.setup_trainer sets device_type "cpu": otherwise autocast falls back to "cuda" and is silently off.
  3. torch.accelerator.synchronize -> no-op: the step timer calls it on every logged step and it raises on CPU.
Run it with the speculators venv's Python: ``python cpu_shim.py train --speculator-type dflash ...``.
"""

import sys

import torch

if not torch.accelerator.is_available():
    torch.accelerator.synchronize = lambda *a, **k: None
    import speculators.train.trainer as trainer

    trainer.get_local_rank = lambda: "cpu"
    _setup = trainer.Trainer.setup_trainer

    def _setup_on_cpu(self):
        self.device_type = "cpu"
        return _setup(self)

    trainer.Trainer.setup_trainer = _setup_on_cpu

from speculators.cli import app  # noqa: E402  (after the patches, which the import must see)

sys.argv[0] = "speculators"
app()
