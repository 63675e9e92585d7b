"""Response regeneration: the target rewrites the assistant turns (self-distillation data). See ``driver`` for
the whole story; the package's parts:

* ``resume``: the resumable rows file, its settings and dropped-ids sidecars, per-row seeds;
* ``jobs``: where in a conversation the target answers, and a conversation being answered slot by slot;
* ``store``: the answer store shared across runs;
* ``hf`` and ``openai_server``: the backends (one interface: ``run(jobs, on_done)``), chosen by
  ``regenerate.backend``;
* ``driver``: ``regenerate_conversations``, which ties them together.
"""

from drafttrain.data.regenerate.driver import BACKENDS, RegenerationResult, regenerate_conversations
from drafttrain.data.regenerate.hf import HFGenerator, SeededGumbelSampling
from drafttrain.data.regenerate.jobs import ConversationJob, Generation, answer_slots
from drafttrain.data.regenerate.openai_server import OpenAIChatClient, parse_chat_completion, wire_messages
from drafttrain.data.regenerate.resume import OutputPaths, RegenerationSettings, read_jsonl_resumable

__all__ = [
    "BACKENDS",
    "ConversationJob",
    "Generation",
    "HFGenerator",
    "OpenAIChatClient",
    "OutputPaths",
    "RegenerationResult",
    "RegenerationSettings",
    "SeededGumbelSampling",
    "answer_slots",
    "parse_chat_completion",
    "read_jsonl_resumable",
    "regenerate_conversations",
    "wire_messages",
]
