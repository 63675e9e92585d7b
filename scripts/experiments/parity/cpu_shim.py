"""Run speculators' CLI on a CPU-only machine (speculators 0.9.0), without editing the installed package.

Three runtime patches, each a one-line change upstream (see scripts/experiments/parity/reference_trainers_on_cpu.md):
  1. trainer.get_local_rank -> "cpu": the rank is only used in ``.to(local_rank)``, which means an accelerator.
  2. Trainer.setup_trainer sets device_type "cpu": otherwise autocast falls back to "cuda" and is silently off.
  3. torch.accelerator.synchronize -> no-op: the step timer calls it on every logged step and it raises on CPU.
Run it with the speculators venv's Python: ``python cpu_shim.py train --speculator-type dflash ...``.

One more, for the P-EAGLE comparison only (``PEAGLE_FROZEN_EMBEDDINGS=1``, set by reference.py --kind peagle): P-EAGLE's
config trains the whole token embedding table (``embed_requires_grad`` True, its default, which the CLI's
``--no-embed-requires-grad`` does not reach), where drafttrain's head reads the target's table and trains the mask
token's row only. The patch makes the flag's False the default, as eagle3's is, so the two heads compute alike.
"""

import os
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

if os.environ.get("PEAGLE_FROZEN_EMBEDDINGS") == "1":
    from speculators.models.peagle.config import PEagleSpeculatorConfig

    _config_init = PEagleSpeculatorConfig.__init__

    def _frozen_embeddings(self, **data):
        data.setdefault("embed_requires_grad", False)
        _config_init(self, **data)

    PEagleSpeculatorConfig.__init__ = _frozen_embeddings

from speculators.cli import app  # noqa: E402  (after the patches, which the import must see)

sys.argv[0] = "speculators"
app()
