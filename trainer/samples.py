"""Decoded samples a person can read: RUN_DIR/samples.jsonl, a few trained samples of every `samples_every`-th step
(and of the first) as text, to see what the model writes and what the reward made of it.

Each line is one sequence of a trained sample, decoded with the trained model's tokenizer from the very token ids the
step trained (never re-tokenized), special tokens kept (the chat template's markers, EOS: what the reward saw
around the answer). `prompt` is the sequence up to the first token the model generated, `completion` the rest (in
an agent's `concat` sequence, tool and user turns between the model's tokens are part of it). The samples are taken
round robin over the step's groups (a sample of each group, then another of each, ...), so they show different
prompts.

Append-only like metrics.jsonl: a restarted trainer cuts it back to its checkpoint's step (`cut`) and writes the
steps it redoes again, so each step appears once. Only the trainer's rank 0 writes it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import msgspec

from rollq.protocol.messages import Trajectory
from rollq.trainer.batch import Group
from rollq.trainer.metrics import read_records

SAMPLES_FILE = "samples.jsonl"


class SampleRecord(msgspec.Struct, kw_only=True):
    """One line of samples.jsonl."""

    step: int  # the step that trained it
    group: str  # its group (the job id its prompt's samples share)
    sample_index: int
    sequence: int  # which of the sample's sequences (one, unless an agent's sample has a sequence per completion)
    reward: float
    prompt: str
    completion: str
    version: int  # the policy version the step trained
    versions: list[int]  # the policy versions that generated the completion's tokens
    prompt_tokens: int
    completion_tokens: int  # tokens of `completion`, the model's and (concat) those between them


def round_robin(groups: list[Group], count: int) -> Iterator[Trajectory]:
    """Up to `count` samples of `groups`: the first (to arrive) of each group, then the second of each, ..."""
    taken = 0
    for i in range(max((len(g.samples) for g in groups), default=0)):
        for g in groups:
            if taken == count:
                return
            if i < len(g.samples):
                taken += 1
                yield g.samples[i]


class SampleLog:
    """RUN_DIR/samples.jsonl. `tokenizer` is called once, when the first samples are decoded (off the event loop)."""

    def __init__(
        self, run_dir: Path, *, every: int, per_step: int, tokenizer: Callable[[], Any], out: TextIO | None = None
    ) -> None:
        self.path = Path(run_dir) / SAMPLES_FILE
        self.every = every
        self.per_step = per_step
        self._load_tokenizer = tokenizer
        self._tokenizer: Any = None
        self.out = out  # where the file is said, once per trainer life (the run's progress output)
        self._announced = False

    def due(self, step: int) -> bool:
        """Whether `step`'s samples are written: the first step and every `every`-th (0 or no samples: never)."""
        return self.every > 0 and self.per_step > 0 and (step == 1 or step % self.every == 0)

    def records(self, step: int, version: int, groups: list[Group]) -> list[SampleRecord]:
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        decode = self._tokenizer.decode
        out = []
        for t in round_robin(groups, self.per_step):
            for k, seq in enumerate(t.sequences):
                ids = list(seq.input_ids)
                cut = seq.completion_start()
                generated = [int(v) for v, m in zip(seq.versions, seq.loss_mask, strict=True) if m]
                out.append(
                    SampleRecord(
                        step=step,
                        group=t.job_id,
                        sample_index=t.sample_index,
                        sequence=k,
                        reward=float(seq.reward),
                        prompt=decode(ids[:cut], skip_special_tokens=False),
                        completion=decode(ids[cut:], skip_special_tokens=False),
                        version=version,
                        versions=sorted(set(generated)),
                        prompt_tokens=cut,
                        completion_tokens=len(ids) - cut,
                    )
                )
        return out

    def write(self, step: int, version: int, groups: list[Group]) -> int:
        """Appends `step`'s samples when it is due; returns the lines written."""
        if not self.due(step):
            return 0
        records = self.records(step, version, groups)
        if records:
            with self.path.open("ab") as f:
                f.write(b"".join(msgspec.json.encode(r) + b"\n" for r in records))
        if records and not self._announced and self.out is not None:
            self._announced = True
            self.out.write(notice(self.path, self.every, self.per_step) + "\n")
            self.out.flush()
        return len(records)

    def cut(self, last_step: int) -> None:
        """Keep the samples of steps up to `last_step` (those the checkpoint holds; 0: none, a fresh start)."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_bytes().splitlines(keepends=True):
            try:
                if msgspec.json.decode(line)["step"] <= last_step:
                    kept.append(line if line.endswith(b"\n") else line + b"\n")
            except (msgspec.DecodeError, KeyError, TypeError):  # the torn tail of a write a crash interrupted
                pass
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(b"".join(kept))
        os.replace(tmp, self.path)


def notice(path: Path, every: int, per_step: int) -> str:
    """The progress output's one line saying where the decoded samples are."""
    cadence = "every step" if every == 1 else f"step 1 and every {every} steps"
    return f"decoded samples ({per_step} of {cadence}): {path}  (read with: jq . {path})"


def read(path: Path) -> list[SampleRecord]:
    return read_records(path, SampleRecord)


__all__ = ["SAMPLES_FILE", "SampleLog", "SampleRecord", "notice", "read", "round_robin"]
