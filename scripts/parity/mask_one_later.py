"""drafttrain's trainer with speculators' loss-mask alignment, for one parity arm (issue 27); never a product setting.

drafttrain's EAGLE-3 step trains the prediction of token t+2 (from the hidden of t and token t+1) when token t+2 is
an assistant token: the mask of the token predicted. speculators 0.9.0 (`shift_batch`) uses the mask of the token fed
in, t+1: one position later at both ends of an answer (it skips the answer's first token and trains the token after
its end). This wrapper runs `drafttrain` with every batch's loss mask moved one position later (and kept inside the
row), which is that alignment, and changes nothing else. (One exception: a row cut at max_length inside an
answer loses the prediction from its last position, which speculators would still train; rows that end an answer
end with an untrained newline.) eagle3.sh runs it for a variant whose overrides start with `shim:mask_one_later`.
"""

import sys

import torch

from drafttrain.commands import main
from drafttrain.drafts.eagle3 import Eagle3Drafter

_own_step = Eagle3Drafter.training_step


def _step_with_the_fed_tokens_mask(self, batch, outputs):
    mask = batch["loss_mask"]
    later = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1) * batch["attention_mask"]
    return _own_step(self, {**batch, "loss_mask": later}, outputs)


if __name__ == "__main__":  # patched only when run, so importing this file changes nothing
    Eagle3Drafter.training_step = _step_with_the_fed_tokens_mask
    sys.exit(main())
