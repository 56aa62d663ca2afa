"""Per-episode sessions of the recording proxy and the completions recorded in them.

An agent episode gets a session key; it is the only credential the proxy accepts for that episode's records, so
concurrent episodes of one worker can neither see nor extend each other's conversations. A completion's parent is
the earlier completion (of the same session) whose conversation, including its own reply, the new request extends.

Only delivered completions count: one whose response never reached the client (it timed out and retried, or went
away) is not the agent's history, so it is never rewarded, trained or used as a parent.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from rollq.workers.proxy.vision import PromptVision

if TYPE_CHECKING:
    from rollq.tracing import Tracing


class CompletionRecord(msgspec.Struct, kw_only=True):
    """One choice of one completion request, token-exact: `output_*` are the engine's ids/logprobs/versions."""

    id: str  # the response id the client sees; choices of an n > 1 request share it
    choice: int
    order: int  # creation order within the session
    parent: str | None  # key of the record this one's prompt extends (None: a root)
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str
    # What the parent match compares: the request's normalised messages and tools, and the normalised reply.
    messages: list[Any] | None = None
    tools: Any = None
    reply: Any = None
    vision: PromptVision | None = None  # the prompt's images (the export's sequences carry them), None: text only
    reward: float | None = None
    delivered: bool = False  # the whole response was handed to the client's connection

    @property
    def key(self) -> str:
        return self.id if self.choice == 0 else f"{self.id}:{self.choice}"

    @property
    def full_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class SessionClosed(Exception):
    """The session's episode finished; its key no longer works."""


class Session:
    def __init__(self, key: str, defaults: dict[str, Any] | None = None) -> None:
        self.key = key
        self.defaults = defaults or {}  # per-episode request defaults (max_tokens)
        self.priority: int | None = None  # the episode's job class priority, given to its engine requests
        self.lora: str | None = None  # the episode's LoRA adapter (Job.lora), named by its engine requests
        # The episode's span (rollq/tracing.py), when traced: the proxy's completions are its children.
        self.tracing: Tracing | None = None
        self.traceparent = ""
        self.records: dict[str, CompletionRecord] = {}
        # Responses API: each response's conversation without its instructions (for previous_response_id).
        self.response_inputs: dict[str, list[Any]] = {}
        self.closed = False
        self._order = 0

    def next_order(self) -> int:
        self._order += 1
        return self._order

    def add(self, record: CompletionRecord) -> None:
        if self.closed:
            raise SessionClosed("the episode of this session key has finished")
        self.records[record.key] = record

    def ordered(self) -> list[CompletionRecord]:
        """The delivered completions in creation order."""
        return sorted((r for r in self.records.values() if r.delivered), key=lambda r: (r.order, r.choice))

    def chat_parent(self, messages: list[Any], tools: Any) -> tuple[CompletionRecord, int] | None:
        """The record whose messages + reply are the longest prefix of `messages` (same tools), and where the new
        messages start."""
        best: tuple[CompletionRecord, int] | None = None
        for rec in self.records.values():
            if rec.messages is None or rec.tools != tools or not rec.delivered:
                continue
            k = len(rec.messages)
            if len(messages) <= k or (best is not None and k + 1 <= best[1]):
                continue
            if messages[k] == rec.reply and messages[:k] == rec.messages:
                best = (rec, k + 1)
        return best

    def token_parent(self, prompt_ids: list[int]) -> CompletionRecord | None:
        """The record whose prompt + output is the longest prefix of `prompt_ids` (completions API)."""
        best: CompletionRecord | None = None
        for rec in self.records.values():
            n = len(rec.prompt_ids) + len(rec.output_ids)
            if (
                rec.delivered
                and n <= len(prompt_ids)
                and (best is None or n > len(best.full_ids))
                and prompt_ids[:n] == rec.full_ids
            ):
                best = rec
        return best


class SessionStore:
    """Live sessions by key. One per proxy (so per worker process)."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}

    def open(self, defaults: dict[str, Any] | None = None) -> Session:
        session = Session(f"rollq-{secrets.token_urlsafe(24)}", defaults)
        self._sessions[session.key] = session
        return session

    def get(self, key: str) -> Session | None:
        return self._sessions.get(key)

    def close(self, session: Session) -> None:
        session.closed = True
        self._sessions.pop(session.key, None)

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))


__all__ = ["CompletionRecord", "Session", "SessionClosed", "SessionStore"]
