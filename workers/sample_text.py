"""Decoded text of a sample's sequences, for the jobs that ask for it (Job.text: the ingress's `"text": true`).

The worker decodes, not the ingress: it has the model's tokenizer (the one its workflows and its agents' proxy
tokenize with), the ingress may have none. The tokenizer is the job's workflow's (`workflow_kwargs.tokenizer`, a
model name a job may give: rollq.workers.model_names), else the worker's own `tokenizer`. The ids are decoded as they
are (never re-tokenized), special tokens kept: what the reward read around the answer."""

from __future__ import annotations

import asyncio
from typing import Any

from rollq.protocol.messages import Job, Sequence, SequenceText
from rollq.workers.chat_template import LazyTokenizer


class SampleText:
    """One worker's decoders, loaded once per tokenizer name."""

    def __init__(self, worker_tokenizer: str) -> None:
        self.worker_tokenizer = worker_tokenizer
        self._tokenizers: dict[str, LazyTokenizer] = {}

    def tokenizer_of(self, job: Job) -> LazyTokenizer:
        """The job's tokenizer (not loaded yet). A name the job may not give raises WorkflowLoadError, as its
        workflow would: called before the episode runs, so the job is refused without running."""
        named = (job.workflow_kwargs or {}).get("tokenizer")
        name = named if isinstance(named, str) and named else self.worker_tokenizer
        if name not in self._tokenizers:
            self._tokenizers[name] = LazyTokenizer(name)  # checks the name
        return self._tokenizers[name]

    async def add(self, tokenizer: LazyTokenizer, sequences: list[Sequence]) -> None:
        """Each sequence's `text`, decoded off the event loop."""
        loaded = await tokenizer.get()
        await asyncio.to_thread(decode_into, loaded, sequences)


def decode_into(tokenizer: Any, sequences: list[Sequence]) -> None:
    for seq in sequences:
        ids = list(seq.input_ids)
        cut = seq.completion_start()
        seq.text = SequenceText(
            prompt=tokenizer.decode(ids[:cut], skip_special_tokens=False),
            completion=tokenizer.decode(ids[cut:], skip_special_tokens=False),
        )


__all__ = ["SampleText", "decode_into"]
