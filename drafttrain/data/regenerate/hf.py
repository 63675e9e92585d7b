"""The ``hf`` regeneration backend: the target in this process answers batches of prompts with HF ``generate``
(left padding; per-row seeded sampling, so a row's answer never depends on its batch-mates)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessorList

from drafttrain import DrafttrainError
from drafttrain.config import RegenerateConfig
from drafttrain.cpu_linear import PackedLinears
from drafttrain.data.chat import chat_template_text, prompt_ids, stop_token_ids
from drafttrain.data.regenerate.jobs import AnsweringModel, ConversationJob, Generation
from drafttrain.data.regenerate.resume import RegenerationSettings, row_seed
from drafttrain.sampling import Sampling, warp_logits


class SeededGumbelSampling:
    """Logits processor for reproducible per-row sampling inside a greedy ``generate``.

    argmax(warped logits + Gumbel noise) is an exact sample from the warped distribution (drafttrain.sampling).
    Each row draws its noise from its own generator, so its answer does not depend on its batch-mates.
    """
    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float):
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self.sampling = Sampling(temperature, top_p)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = warp_logits(scores, self.sampling)
        uniform = torch.stack([torch.rand(scores.shape[-1], generator=g) for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp_(1e-10, 1.0 - 1e-7)))
        return scores + gumbel.to(scores.device)


class HFGenerator:
    """Generate with a local transformers model: batches of prompts, left-padded."""
    def __init__(self, model, tokenizer, settings: RegenerationSettings):
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        chat_template_text(tokenizer)  # the answers must be rendered as training will render them
        self.stop_ids = stop_token_ids(tokenizer, model.generation_config)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.pad_id = int(pad)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        # An explicit config, so generation defaults shipped with the model (temperature, top_k...) never apply.
        self.generation_config = GenerationConfig(
            max_new_tokens=settings.max_new_tokens,
            do_sample=False,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
        )

    def prompt_fits(self, prompt_ids: list[int]) -> bool:
        return self.max_positions is None or len(prompt_ids) + self.settings.max_new_tokens <= self.max_positions

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Generation]:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        processors = LogitsProcessorList()
        if self.settings.temperature > 0:
            processors.append(SeededGumbelSampling(seeds, self.settings.temperature, self.settings.top_p))
        with PackedLinears(self.model):  # on a CPU, oneDNN's packed kernels: faster at every batch width here
            output = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=self.generation_config,
                logits_processor=processors,
            )
        return [self._decode(seq) for seq in output[:, width:].tolist()]

    def _decode(self, new_tokens: list[int]) -> Generation:
        stops = set(self.stop_ids)
        for position, token in enumerate(new_tokens):
            if token in stops:
                text = self.tokenizer.decode(new_tokens[:position], skip_special_tokens=True)
                return Generation(text, "stop", position + 1)
        return Generation(self.tokenizer.decode(new_tokens, skip_special_tokens=True), "length", len(new_tokens))


def _first_prompt_chars(job: ConversationJob) -> int:
    """Length of the first prompt in characters: a cheap stand-in for its token count, to group similar rows."""
    upto = job.slots[0][0] if job.slots else 0
    return sum(len(m.get("content") or "") for m in job.messages[:upto])


class HFBackend:
    """``regenerate.backend: hf``: batched ``generate`` of the target loaded in this process."""
    def __init__(self, target: AnsweringModel | None, cfg: RegenerateConfig, settings: RegenerationSettings):
        if target is None:
            raise DrafttrainError("regenerate backend 'hf' needs the target model loaded")
        self.generator = HFGenerator(target.model, target.tokenizer, settings)
        self.cfg, self.settings = cfg, settings

    def run(self, jobs: list[ConversationJob], on_done: Callable[[ConversationJob], None]) -> None:
        """Regenerate ``jobs`` in batches of ``batch_size`` conversations (fewer where ``max_batch_tokens`` says so);
        each round answers one slot of each.

        Conversations with as many turns and similar lengths share a batch (less padding, no single-turn row waiting
        for a long multi-turn one). Rows are written as they finish, so this order never shows in the results.
        """
        jobs = sorted(jobs, key=lambda job: (len(job.slots), _first_prompt_chars(job)))
        for batch in self._batches(jobs):
            for job in batch:
                if job.done:  # nothing to answer (e.g. only tool calls)
                    on_done(job)
            active = [job for job in batch if not job.done]
            while active:
                prompts, seeds, ready = [], [], []
                for job in active:
                    ids = prompt_ids(self.generator.tokenizer, job.pending_prompt(), job.conversation.get("tools"))
                    if not self.generator.prompt_fits(ids):
                        job.drop_reason = "prompt_too_long"
                        on_done(job)
                        continue
                    prompts.append(ids)
                    seeds.append(row_seed(self.settings.seed, str(job.conversation["id"]), job.next_slot))
                    ready.append(job)
                if ready:
                    for job, generation in zip(ready, self.generator.generate(prompts, seeds)):
                        job.accept(generation, self.cfg.keep_original_on_empty)
                        if job.done:
                            on_done(job)
                active = [job for job in ready if not job.done]

    def _batches(self, jobs: list[ConversationJob]):
        """Consecutive ``jobs`` in batches of at most ``batch_size`` and, with ``max_batch_tokens``, of at most that
        many padded tokens in the first round (rows x the widest row's prompt + max_new_tokens)."""
        limit, batch, widest = self.cfg.max_batch_tokens, [], 0
        for job in jobs:
            width = self._first_round_tokens(job) if limit else 0
            full = len(batch) == self.cfg.batch_size or (limit and max(widest, width) * (len(batch) + 1) > limit)
            if batch and full:
                yield batch
                batch, widest = [], 0
            batch.append(job)
            widest = max(widest, width)
        if batch:
            yield batch

    def _first_round_tokens(self, job: ConversationJob) -> int:
        if job.done:
            return 0
        ids = prompt_ids(self.generator.tokenizer, job.pending_prompt(), job.conversation.get("tools"))
        return len(ids) + self.settings.max_new_tokens
