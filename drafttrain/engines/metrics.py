"""A serving engine's speculative-decoding counters, read from its Prometheus ``/metrics`` text and differenced.

Only counters are read, before and after each level, and the level's figures come from their differences: an
engine's running averages (SGLang's ``spec_accept_length`` is one, over the server's whole life) would mix every
earlier level into the next.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from drafttrain import DrafttrainError


def counter_samples(text: str) -> dict[str, dict[tuple, float]]:
    """Every counter sample of a /metrics text: {sample name: {its labels, without the engine's bookkeeping ones:
    summed value}}. Samples of several engines or models of one server are added together."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as err:
        raise DrafttrainError(f"the /metrics text is not Prometheus' text format ({err})") from None
    out: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
    for family in families:
        if family.type != "counter":
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("engine", "model_name")))
            out[sample.name][labels] += sample.value
    return out


def total(samples: dict[str, dict[tuple, float]], name: str) -> float | None:
    """The sum of counter ``name`` over its labels (None: the server does not export it)."""
    values = samples.get(name)
    return None if values is None else sum(values.values())


def by_label(samples: dict[str, dict[tuple, float]], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for labels, value in (samples.get(name) or {}).items():
        key = dict(labels).get(label)
        if key is not None:
            out[key] += value
    return dict(out)


@dataclasses.dataclass(frozen=True)
class SpecCounters:
    """What one engine counted of speculative decoding (cumulative, or a difference of two readings)."""

    verify_steps: float  # target forwards that verified a draft (vLLM: num_drafts; SGLang: verify calls)
    generated: float  # output tokens
    accepted: float | None = None  # accepted draft tokens (None: the engine counts only steps and tokens)
    drafted: float | None = None  # draft tokens proposed
    accepted_per_position: tuple[float, ...] = ()  # [k]: drafts whose token k+1 was accepted (vLLM)

    def __sub__(self, before: "SpecCounters") -> "SpecCounters":
        def diff(a, b):
            return None if a is None or b is None else a - b
        width = max(len(self.accepted_per_position), len(before.accepted_per_position))
        pad = lambda values: tuple(values) + (0.0,) * (width - len(values))  # noqa: E731
        per = tuple(a - b for a, b in zip(pad(self.accepted_per_position), pad(before.accepted_per_position)))
        delta = SpecCounters(self.verify_steps - before.verify_steps, self.generated - before.generated,
                             diff(self.accepted, before.accepted), diff(self.drafted, before.drafted), per)
        if delta.verify_steps < 0 or delta.generated < 0:
            raise DrafttrainError("the engine's counters went backwards between two readings: the server restarted "
                                  "during the level")
        return delta

    def acceptance_length(self) -> float | None:
        """Tokens per verification step (τ): 1 + accepted/steps where accepted tokens are counted, else output
        tokens per step (which also counts each request's first token, made by the prefill, so it reads a little
        high on short answers)."""
        if self.verify_steps <= 0:
            return None
        if self.accepted is not None:
            return 1 + self.accepted / self.verify_steps
        return self.generated / self.verify_steps

    def per_position(self) -> list[float]:
        """The share of drafts whose k-th token was accepted, for k = 1, 2, ..."""
        if self.verify_steps <= 0:
            return []
        return [n / self.verify_steps for n in self.accepted_per_position]
