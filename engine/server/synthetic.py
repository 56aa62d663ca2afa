"""SyntheticBackend: a model-free Backend with deterministic tokens and configurable latency and output lengths.

Used to test the server, the client and the pool, and to benchmark the rollout system without a GPU.

Token at absolute position p is a hash of (seed, every token before p): a resubmission of prompt + partial output
continues exactly as the uninterrupted run would (what a greedy model does). The output *length* is drawn once per
request from a hash of its prompt, so a resubmitted remainder draws a fresh length (only pause/resume within one
server keeps it); use `ignore_eos` when exact replays matter.

Agent tests: `tokenizer="tiny"` (or an HF tokenizer directory) swaps the byte tokenizer for a real chat tokenizer,
and `replies` scripts the output text per assistant turn (see `SyntheticConfig`). A scripted reply is located from
the token ids alone, so a resubmitted prompt + partial output continues the same reply, token for token."""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import random
import re
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import msgspec

from rollq.engine.eos import model_eos_ids
from rollq.engine.server.backend import Backend, GenState, stop_check
from rollq.engine.server.lora_registry import AdapterRef
from rollq.engine.types import FinishReason, PauseMode

_MASK = (1 << 64) - 1
_MUL = 0x9E3779B97F4A7C15  # odd: the rolling hash is a bijection of the previous state for a fixed token
_NUM_SPECIAL = 3  # ids 0..2 are special (pad, bos, eos); text bytes map to ids 3..258
_ABORT_POLL_S = 0.01  # how often a paused backend looks for aborted states (the contract gives no wake-up)


def _mix(h: int) -> int:
    """splitmix64 finaliser: spreads the rolling hash's bits."""
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
    return h ^ (h >> 31)


class LengthDist(msgspec.Struct, kw_only=True, frozen=True):
    """Output-length distribution (tokens including the final eos), always capped by max_new_tokens.

    fixed: `length` (None: never emit eos, finish by length) | uniform: [low, high] |
    lognormal: median `median`, shape `sigma` | pareto: minimum `xmin`, tail index `alpha` (heavy tail)."""

    kind: Literal["fixed", "uniform", "lognormal", "pareto"] = "fixed"
    length: int | None = None
    low: int = 1
    high: int = 256
    median: float = 128.0
    sigma: float = 1.0
    xmin: float = 16.0
    alpha: float = 1.5

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """CLI form: `fixed[:N]`, `uniform:LOW:HIGH`, `lognormal:MEDIAN:SIGMA`, `pareto:XMIN:ALPHA`."""
        kind, *args = spec.split(":")
        try:
            if kind == "fixed":
                return cls(kind="fixed", length=int(args[0]) if args else None)
            if kind == "uniform":
                return cls(kind="uniform", low=int(args[0]), high=int(args[1]))
            if kind == "lognormal":
                return cls(kind="lognormal", median=float(args[0]), sigma=float(args[1]))
            if kind == "pareto":
                return cls(kind="pareto", xmin=float(args[0]), alpha=float(args[1]))
        except (IndexError, ValueError):
            pass
        raise ValueError(
            f"bad length distribution {spec!r}: use fixed[:N], uniform:LOW:HIGH, lognormal:MEDIAN:SIGMA "
            "or pareto:XMIN:ALPHA"
        )

    def sample(self, rng: random.Random) -> int | None:
        if self.kind == "fixed":
            return self.length
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        if self.kind == "lognormal":
            return max(1, round(rng.lognormvariate(math.log(self.median), self.sigma)))
        return max(1, round(self.xmin * rng.paretovariate(self.alpha)))


DEFAULT_MODEL_PATH = "synthetic"


class SyntheticConfig(msgspec.Struct, kw_only=True, frozen=True):
    """With `tokenizer` set, vocab_size and eos_token_id come from the tokenizer, and model_path (left at its
    default) reports the tokenizer directory. With `replies` set, output is scripted: the request whose ids hold
    the token sequence of `turn_marker` n times gets `replies[min(n - 1, len(replies) - 1)]` (for a ChatML prompt
    ending in a generation prompt: the reply for its assistant turn), then eos (none with ignore_eos), then hashed
    tokens."""

    model_path: str = DEFAULT_MODEL_PATH
    vocab_size: int = 32000
    context_length: int = 32768
    eos_token_id: int = 2
    tokenizer: str = ""  # "": UTF-8 bytes; "tiny" / "smollm2": engine.tiny_model.model_dir; else an HF directory
    replies: list[str] = []
    turn_marker: str = "<|im_start|>assistant"
    per_token_latency_s: float = 0.0  # one decode step of the whole batch
    per_request_latency_s: float = 0.0  # prefill, paid once per request
    length: LengthDist = LengthDist()
    seed: int = 0
    max_running_requests: int = 0  # batch slots in stepped mode (per_token_latency_s > 0); 0 = unlimited
    kv_capacity_tokens: int = 1_000_000  # denominator of token_usage
    load_delay_s: float = 0.0  # time load_weights takes
    # Sample like a model at temperature > 0: each request (temperature >= 1e-6) mixes a fresh draw into its hash, so
    # the n samples of one prompt differ in tokens and length. A resubmitted remainder is a new draw from its prefix.
    sampled: bool = False
    # Scripted replies of varied length: each reply is prefixed with N filler tokens (ordinary words: never special,
    # eos or tool markers, and stable under decode + re-encode), N drawn from `filler` (capped at filler_max_tokens)
    # seeded by a hash of the prompt up to the turn's marker. The same prompt gets the same reply in any system.
    filler: LengthDist | None = None
    filler_max_tokens: int = 512


def load_tokenizer(name: str) -> tuple[Any, Path]:
    """(HF tokenizer, its directory) for `name`: "tiny" / "smollm2" (built offline on first use) or a tokenizer
    directory."""
    from rollq.engine.models import model_dir

    path = model_dir(name)
    if name == "tiny":
        # transformers' plain tokenizer over tokenizer.json: the same ids, text and chat template as AutoTokenizer's
        # Qwen2Tokenizer for this model (tests/engine/test_synthetic.py checks), without AutoTokenizer's import of
        # torch, which tripled the start-up of an engine that needs no model.
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True), path
    from transformers import AutoTokenizer  # heavy: imported only when a tokenizer is asked for

    return AutoTokenizer.from_pretrained(path, local_files_only=True), path


def _eos_ids(tokenizer: Any, path: Path) -> list[int]:
    ids = model_eos_ids(tokenizer, path)
    if not ids:
        raise ValueError(f"tokenizer at {path} has no eos token")
    return ids


def _count(ids: list[int], pattern: list[int]) -> tuple[int, int]:
    """(non-overlapping occurrences of `pattern` in `ids`, index just past the last one; -1 if none)."""
    n, end, i, k = 0, -1, 0, len(pattern)
    first = pattern[0]
    while True:
        try:
            i = ids.index(first, i)
        except ValueError:
            return n, end
        if ids[i : i + k] == pattern:
            n, end, i = n + 1, i + k, i + k
        else:
            i += 1


class _Seq:
    """Per-state generation cursor: rolling hash of every token so far, the drawn output length and, when scripted,
    the reply's tokens with the index of the next one."""

    __slots__ = ("state", "h", "target", "done", "script", "cursor")

    def __init__(
        self, state: GenState, h: int, target: int | None, script: list[int] | None = None, cursor: int = 0
    ) -> None:
        self.state = state
        self.h = h
        self.target = target
        self.done: asyncio.Future[None] | None = None
        self.script = script
        self.cursor = cursor


class SyntheticBackend(Backend):
    def __init__(self, config: SyntheticConfig | None = None) -> None:
        self.config = config or SyntheticConfig()
        c = self.config
        self.model_path = c.model_path
        self.context_length = c.context_length
        self._tok: Any = None  # HF tokenizer, when configured
        if c.tokenizer:
            self._tok, path = load_tokenizer(c.tokenizer)
            if c.model_path == DEFAULT_MODEL_PATH:
                self.model_path = str(path)
            self.vocab_size = len(self._tok)
            eos = _eos_ids(self._tok, path)
        else:
            if c.vocab_size <= _NUM_SPECIAL + 256:
                raise ValueError("vocab_size must exceed 259 (3 special ids + 256 byte ids)")
            self.vocab_size = c.vocab_size
            eos = [c.eos_token_id]
        self._eos = eos[0]  # the eos this backend emits
        self.eos_token_ids = frozenset(eos)
        if len(self.eos_token_ids) >= self.vocab_size - _NUM_SPECIAL:
            raise ValueError("the vocabulary needs ids that are not eos")
        self._span = self.vocab_size - _NUM_SPECIAL
        # Scripted replies, tokenized once; the marker locates the turn (and, on a resubmission, the partial reply).
        self._replies = [self.encode(r) for r in c.replies]
        self._marker = self.encode(c.turn_marker) if c.replies else []
        if c.replies and not self._marker:
            raise ValueError("turn_marker must not be empty")
        self._newline = self.encode("\n")
        self._filler = self._filler_tokens() if c.filler is not None and c.replies else []
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._active: list[_Seq] = []  # stepped mode: states decoding
        self._queue: deque[_Seq] = deque()  # stepped mode: states waiting for a batch slot
        self._stepper: asyncio.Task | None = None
        self._kick = asyncio.Event()  # wakes an idle stepper
        self._inline = 0  # states generating in latency-0 mode
        self._inline_tokens = 0
        self._tokens_total = 0
        self._window: deque[tuple[float, int]] = deque()  # (time, tokens_total) samples for gen_throughput
        self._draws = random.Random(c.seed)  # per-request draws of a sampled backend (reproducible per process)

    # --- tokenizer: the configured HF tokenizer, else UTF-8 bytes shifted past the special ids ---

    def encode(self, text: str) -> list[int]:
        if self._tok is not None:
            return list(self._tok.encode(text, add_special_tokens=False))
        return [b + _NUM_SPECIAL for b in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # The server decodes output text with the default, as SGLang does (special tokens dropped).
        if self._tok is not None:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        data = bytes((i - _NUM_SPECIAL) & 0xFF for i in ids if i >= _NUM_SPECIAL)
        return data.decode(errors="replace")

    def _filler_tokens(self) -> list[int]:
        """Ordinary word tokens for reply fillers: each decodes to one lower-case word (one letter for the byte
        tokenizer; a leading space and a word for an HF tokenizer, whose pre-tokenizer splits on the space) that
        encodes back to that one id; a long sample is checked to decode and re-encode to itself."""
        word = re.compile(r"[a-z]" if self._tok is None else r" [a-z]{2,}")
        found = []
        for t in range(_NUM_SPECIAL, self.vocab_size):
            if t in self.eos_token_ids:
                continue
            text = self.decode([t], skip_special_tokens=False)
            if word.fullmatch(text) and self.encode(text) == [t]:
                found.append(t)
                if len(found) == 256:
                    break
        for tokens in (found, found[:1]):  # a mix of words; else one word repeated
            sample = self._filler_for(0x5EED, 256, tokens)
            if tokens and self.encode(self.decode(sample, skip_special_tokens=False)) == sample:
                return tokens
        raise ValueError("filler: the tokenizer has no word tokens that decode and re-encode stably")

    def _filler_for(self, h: int, n: int, tokens: list[int]) -> list[int]:
        return [tokens[_mix(h ^ k) % len(tokens)] for k in range(n)] if tokens else []

    def _decode_for_stop(self, ids: list[int]) -> str:
        # As SGLang's check_finished: stop strings match the raw tail, special tokens included.
        return self.decode(ids, skip_special_tokens=False)

    # --- generation ---

    def _begin(self, state: GenState) -> _Seq:
        h = self.config.seed & _MASK
        for image in state.images:  # the images come before the text, as a vision model sees them
            h = (h * _MUL + int.from_bytes(hashlib.blake2b(image, digest_size=8).digest(), "little")) & _MASK
        for t in state.input_ids:
            h = (h * _MUL + t + 1) & _MASK
        for t in state.output_ids:  # a state resumed with partial output
            h = (h * _MUL + t + 1) & _MASK
        if self.config.sampled and state.params.temperature >= 1e-6:
            h = _mix(h ^ self._draws.getrandbits(64))
        if self._replies:
            script, cursor = self._locate_reply([*state.input_ids, *state.output_ids], state.params.ignore_eos)
            return _Seq(state, h, None, script, cursor)
        target = self.config.length.sample(random.Random(h))
        if target is not None:
            target = max(target, state.params.min_new_tokens, 1)
        return _Seq(state, h, target)

    def _locate_reply(self, ids: list[int], ignore_eos: bool) -> tuple[list[int], int]:
        """(the scripted tokens for the turn `ids` ends in, how many of them `ids` already holds).

        The turn is the number of markers in `ids`; the tokens after the last marker are the generation prompt's
        newline (when there is one) and then the reply's tokens so far: a resubmission of prompt + partial output
        (or a state resumed with output) finds its place in the same reply. A tail that is no prefix of the reply
        (a prompt without a generation prompt, say) starts the reply from the beginning."""
        n, end = _count(ids, self._marker)
        reply = self._replies[min(max(n - 1, 0), len(self._replies) - 1)]
        if self._filler:  # N filler tokens first, N and the words drawn from the prompt (up to the marker)
            h = self.config.seed & _MASK
            for t in ids[: max(end, 0)]:
                h = (h * _MUL + t + 1) & _MASK
            assert self.config.filler is not None
            size = min(self.config.filler.sample(random.Random(h)) or 0, self.config.filler_max_tokens)
            reply = self._filler_for(h, size, self._filler) + reply
        script = reply if ignore_eos else [*reply, self._eos]
        if end < 0:
            return script, 0
        tail = ids[end:]
        # The generation prompt's newline is the usual case; the unstripped reading serves a marker that ends in one.
        skips = (len(self._newline), 0) if self._newline and tail[: len(self._newline)] == self._newline else (0,)
        for skip in skips:
            done = tail[skip:]
            if done[: len(script)] == script[: len(done)]:  # beyond the script: hashed tokens, consistent by design
                return script, len(done)
        return script, 0

    def _step(self, seq: _Seq) -> bool:
        """Append one token; returns True when the state finished."""
        state = seq.state
        if state.abort_message is not None:
            state.finish = FinishReason(type="abort", message=state.abort_message)
            return True
        m = _mix(seq.h ^ (len(state.input_ids) + len(state.output_ids)))  # position too
        if seq.script is not None and seq.cursor < len(seq.script):
            token = seq.script[seq.cursor]
            seq.cursor += 1
        elif seq.target is not None and len(state.output_ids) + 1 >= seq.target and not state.params.ignore_eos:
            token = self._eos
        else:
            token = _NUM_SPECIAL + m % self._span
            while token in self.eos_token_ids:
                token = _NUM_SPECIAL + (token + 1 - _NUM_SPECIAL) % self._span
        state.output_ids.append(token)
        # Deterministic logprob in (-4, 0): the same bits for the same position and history.
        state.output_logprobs.append(-((m >> 11) / 2.0**53) * 4.0 - 1e-4)
        if state.first_token_at is None:
            state.first_token_at = time.monotonic()
        seq.h = (seq.h * _MUL + token + 1) & _MASK
        self._tokens_total += 1
        state.finish = stop_check(
            state, token, self.eos_token_ids, self._decode_for_stop if state.params.stop else None
        )
        return state.finish is not None

    async def _wait_resumed(self, current: Callable[[], list[_Seq]]) -> None:
        """Paused: wait for resume, but let aborted states finish meanwhile (returns early once all finished)."""
        while not self._resumed.is_set():
            seqs = current()
            for seq in seqs:
                if seq.state.abort_message is not None and seq.state.finish is None:
                    self._step(seq)
                    if seq.done is not None and not seq.done.done():
                        seq.done.set_result(None)
            if all(s.state.finish is not None for s in seqs) and seqs:
                return
            try:
                await asyncio.wait_for(self._resumed.wait(), _ABORT_POLL_S)
            except TimeoutError:
                pass

    async def run(self, state: GenState) -> None:
        c = self.config
        if c.per_request_latency_s > 0:
            await asyncio.sleep(c.per_request_latency_s)
        seq = self._begin(state)
        if c.per_token_latency_s > 0:
            await self._run_stepped(seq)
        else:
            await self._run_inline(seq)

    async def _run_inline(self, seq: _Seq) -> None:
        # No latency: generate in chunks, yielding between them so aborts, pauses and other requests get a turn.
        self._inline += 1
        try:
            while True:
                if not self._resumed.is_set():
                    await self._wait_resumed(lambda: [seq])
                    if seq.state.finish is not None:
                        return
                for _ in range(256):
                    if self._step(seq):
                        return
                await asyncio.sleep(0)
        finally:
            self._inline -= 1

    async def _run_stepped(self, seq: _Seq) -> None:
        seq.done = asyncio.get_running_loop().create_future()
        # Behind every queued state of the same or a higher priority: larger first, FCFS among equals (as SGLang).
        prio = seq.state.priority or 0
        i = len(self._queue)
        while i > 0 and (self._queue[i - 1].state.priority or 0) < prio:
            i -= 1
        self._queue.insert(i, seq)
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.create_task(self._step_loop(), name="synthetic-stepper")
        self._kick.set()
        try:
            await asyncio.shield(seq.done)
        except asyncio.CancelledError:
            seq.state.abort_message = seq.state.abort_message or "cancelled"
            raise

    def _admit(self) -> None:
        limit = self.config.max_running_requests or math.inf
        while self._queue and len(self._active) < limit:
            self._active.append(self._queue.popleft())

    async def _step_loop(self) -> None:
        """One decode step for every running state per tick, like a batched engine."""
        interval = self.config.per_token_latency_s
        while True:
            if not self._active and not self._queue:
                self._kick.clear()
                await self._kick.wait()
            if not self._resumed.is_set():
                await self._wait_resumed(lambda: self._active + list(self._queue))
                self._active = [s for s in self._active if s.state.finish is None]
                self._queue = deque(s for s in self._queue if s.state.finish is None)
                continue
            tick = time.monotonic()
            self._admit()
            still: list[_Seq] = []
            for seq in self._active:
                if self._step(seq):
                    assert seq.done is not None  # the stepper only holds seqs queued by _run_stepped, with a future
                    if not seq.done.done():
                        seq.done.set_result(None)
                else:
                    still.append(seq)
            self._active = still
            # Queued states that were aborted before getting a slot finish now.
            if self._queue and any(s.state.abort_message is not None for s in self._queue):
                for s in [s for s in self._queue if s.state.abort_message is not None]:
                    self._queue.remove(s)
                    self._step(s)
                    assert s.done is not None
                    s.done.set_result(None)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - tick)))

    async def pause(self, mode: PauseMode) -> None:
        # in_place, retract and abort all stop stepping; retract keeps the partial tokens in the state, and a
        # synthetic model has no KV cache to free, so resuming continues exactly where it stopped.
        self._resumed.clear()

    async def resume(self) -> None:
        self._resumed.set()

    async def load_weights(self, path: str) -> None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"weights not found: {path}")
        if self.config.load_delay_s > 0:
            await asyncio.sleep(self.config.load_delay_s)

    async def load_tensors(self, named: list[tuple[str, Any]], *, adopt: bool = False) -> None:
        if self.config.load_delay_s > 0:  # the tensors themselves are accepted and dropped: there is no model
            await asyncio.sleep(self.config.load_delay_s)

    supports_lora = True  # adapters are read as a LoRA engine would and change nothing: there is no model
    supports_images = True  # images are loaded and checked as a vision engine would; they seed the hashed tokens

    async def load_adapter(self, ref: AdapterRef, path: str) -> None:
        config = Path(path) / "adapter_config.json"
        try:
            peft_type = msgspec.json.decode(config.read_bytes()).get("peft_type")
        except (OSError, msgspec.DecodeError, AttributeError) as exc:
            raise ValueError(f"{path} holds no readable adapter_config.json: {exc}") from None
        if str(peft_type).upper() != "LORA":  # SGLang asserts the same (lora/lora.py:64)
            raise ValueError(f"{path} is not a LoRA adapter (peft_type {peft_type!r})")
        if self.config.load_delay_s > 0:
            await asyncio.sleep(self.config.load_delay_s)

    async def unload_adapter(self, ref: AdapterRef) -> None:
        return None

    async def close(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
            try:
                await self._stepper
            except asyncio.CancelledError:
                pass
            self._stepper = None
        for seq in [*self._active, *self._queue]:
            if seq.state.finish is None:
                seq.state.finish = FinishReason(type="abort", message="engine shutting down")
            if seq.done is not None and not seq.done.done():
                seq.done.set_result(None)
        self._active, self._queue = [], deque()

    def stats(self) -> dict[str, float]:
        now = time.monotonic()
        self._window.append((now, self._tokens_total))
        while len(self._window) > 2 and now - self._window[0][0] > 10.0:
            self._window.popleft()
        t0, n0 = self._window[0]
        throughput = (self._tokens_total - n0) / (now - t0) if now > t0 else 0.0
        held = sum(len(s.state.input_ids) + len(s.state.output_ids) for s in self._active)
        return {
            "num_running_reqs": float(len(self._active) + self._inline),
            "num_queue_reqs": float(len(self._queue)),
            "token_usage": held / self.config.kv_capacity_tokens,
            "gen_throughput": throughput,
        }
