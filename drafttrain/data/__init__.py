"""Data: load and normalise conversations, mix sources, tokenise with assistant-only loss masks, cache as Arrow."""

from drafttrain.data.conversations import FORMATS, LoadedSource, conversation_hash, load_conversations, read_records
from drafttrain.data.sources import Mixture, format_mixture_stats, load_mixture
from drafttrain.data.tokenize import (
    assistant_spans,
    build_tokenized_dataset,
    format_tokenize_stats,
    length_grouped_order,
    pack,
    tokenize_conversation,
)

__all__ = [
    "FORMATS",
    "LoadedSource",
    "Mixture",
    "assistant_spans",
    "build_tokenized_dataset",
    "conversation_hash",
    "format_mixture_stats",
    "format_tokenize_stats",
    "length_grouped_order",
    "load_conversations",
    "load_mixture",
    "pack",
    "read_records",
    "tokenize_conversation",
]
