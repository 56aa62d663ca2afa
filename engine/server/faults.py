"""Fault injection: `rollq engine --fault step_error[:MIN_PROMPT_TOKENS]` makes generation fail the way a model forward
that raises does in the reference engine, so tests and drills can watch a failing engine surface everywhere (the
client's error, the health route, `rollq up`'s console, the trainer's exit) without a broken model.

What a failed step does in the reference engine (engine/server/reference.py, `ReferenceBackend._iterate`): the
traceback is logged at ERROR and every state of the step finishes with an engine-error abort, `{"type": "abort",
"message": "engine error: ...", "status_code": 500, "err_type": <the exception's type>}`, before its first token when
it was being prefilled. `FaultyBackend` does exactly that to each state the fault hits, and leaves every other call
(weights, pause, adapters, tokenizer) to the backend it wraps, so a faulty engine still starts, loads weights and
answers control routes. `min_prompt_tokens` hits only prompts at least that long: 2 keeps the one-token health probe
working while real requests fail, as a failure of the shared-prefix path (issue 42's E1) did.

`rollq engine --fault hold_load:DIR` stops every weight load halfway, so a test can SIGKILL an engine while its
weights are half old, half new (a delta's swap, a distributed update) without timing it: the first half of the
tensors is copied in (a disk load holds before it starts), then the engine writes `DIR/holding` and waits until
`DIR/release` exists (at most HOLD_LIMIT_S, then the load fails) before copying the rest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from rollq.engine.server.backend import Backend, GenState
from rollq.engine.server.lora_registry import AdapterRef
from rollq.engine.types import FinishReason, PauseMode
from rollq.protocol.media import ImageFile

log = logging.getLogger("rollq.engine")

FAULT_KINDS = ("step_error", "hold_load")
HOLD_LIMIT_S = 300.0  # a held load fails after this long (a test that forgot to release or kill the engine)
HOLD_POLL_S = 0.01


class InjectedStepError(RuntimeError):
    """The exception an injected step failure raises (its name is the abort's err_type)."""


class StepFault(msgspec.Struct, frozen=True, kw_only=True):
    """Which generations fail: every state whose prompt holds at least `min_prompt_tokens` tokens (0: all)."""

    min_prompt_tokens: int = 0

    @classmethod
    def parse(cls, spec: str) -> StepFault:
        """CLI form: `step_error` or `step_error:MIN_PROMPT_TOKENS`."""
        fault = parse_fault(spec)
        if not isinstance(fault, StepFault):
            raise ValueError(f"bad fault {spec!r}: not a step_error")
        return fault

    def hits(self, state: GenState) -> bool:
        return len(state.input_ids) >= self.min_prompt_tokens


class LoadHold(msgspec.Struct, frozen=True, kw_only=True):
    """Weight loads stop halfway until `directory/release` exists (see the module docstring)."""

    directory: str

    async def hold(self) -> None:
        where = Path(self.directory)
        (where / "holding").touch()
        log.warning("fault hold_load: a weight load holds until %s exists", where / "release")
        deadline = time.monotonic() + HOLD_LIMIT_S
        while not (where / "release").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"fault hold_load: {where / 'release'} did not appear in {HOLD_LIMIT_S:.0f} s")
            await asyncio.sleep(HOLD_POLL_S)


Fault = StepFault | LoadHold


def parse_fault(spec: str) -> Fault:
    """CLI form: `step_error`, `step_error:MIN_PROMPT_TOKENS` or `hold_load:DIR`."""
    kind, _, arg = spec.partition(":")
    if kind == "step_error":
        try:
            tokens = int(arg) if arg else 0
        except ValueError:
            tokens = -1
        if tokens >= 0:
            return StepFault(min_prompt_tokens=tokens)
    if kind == "hold_load" and arg:
        return LoadHold(directory=arg)
    raise ValueError(f"bad fault {spec!r}: use step_error, step_error:MIN_PROMPT_TOKENS or hold_load:DIR")


class FaultyBackend(Backend):
    """`inner` with generation failing as `fault` says (see the module docstring)."""

    def __init__(self, inner: Backend, fault: Fault) -> None:
        self.inner = inner
        self.fault = fault
        self.model_path = inner.model_path
        self.vocab_size = inner.vocab_size
        self.context_length = inner.context_length
        self.eos_token_ids = inner.eos_token_ids
        self.supports_lora = inner.supports_lora
        self.supports_images = inner.supports_images
        self.holds_weights = inner.holds_weights
        self.served_dtype = inner.served_dtype
        self.failed_steps = 0  # states failed so far (tests read it)

    async def start(self) -> None:
        await self.inner.start()
        # A backend learns its model's sizes while starting (the reference one loads the model here)
        self.model_path = self.inner.model_path
        self.vocab_size = self.inner.vocab_size
        self.context_length = self.inner.context_length
        self.eos_token_ids = self.inner.eos_token_ids
        self.supports_images = self.inner.supports_images
        self.served_dtype = self.inner.served_dtype

    async def close(self) -> None:
        await self.inner.close()

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids)

    def prepare_images(self, input_ids: list[int], images: list[ImageFile]) -> tuple[list[int], Any]:
        return self.inner.prepare_images(input_ids, images)

    async def run(self, state: GenState) -> None:
        if not isinstance(self.fault, StepFault) or not self.fault.hits(state):
            await self.inner.run(state)
            return
        self.failed_steps += 1
        try:
            raise InjectedStepError(f"injected step failure (fault step_error:{self.fault.min_prompt_tokens})")
        except InjectedStepError as exc:
            # The reference engine's words and shape for a failed step (reference.py, _iterate's except block)
            log.exception("engine step failed; aborting the running batch")
            state.finish = FinishReason(
                type="abort", message=f"engine error: {exc!r}", status_code=500, err_type=type(exc).__name__
            )

    async def pause(self, mode: PauseMode) -> None:
        await self.inner.pause(mode)

    async def resume(self) -> None:
        await self.inner.resume()

    async def load_weights(self, path: str) -> None:
        if isinstance(self.fault, LoadHold):
            await self.fault.hold()
        await self.inner.load_weights(path)

    async def load_tensors(self, named: list[tuple[str, Any]], *, adopt: bool = False) -> None:
        if not isinstance(self.fault, LoadHold):
            await self.inner.load_tensors(named, adopt=adopt)
            return
        half = (len(named) + 1) // 2
        await self.inner.load_tensors(named[:half], adopt=adopt)
        await self.fault.hold()
        await self.inner.load_tensors(named[half:], adopt=adopt)

    def served_weights(self) -> Mapping[str, Any]:
        return self.inner.served_weights()

    async def load_adapter(self, ref: AdapterRef, path: str) -> None:
        await self.inner.load_adapter(ref, path)

    async def unload_adapter(self, ref: AdapterRef) -> None:
        await self.inner.unload_adapter(ref)

    def flush_cache(self) -> None:
        self.inner.flush_cache()

    def stats(self) -> dict[str, float]:
        return self.inner.stats()


__all__ = ["FAULT_KINDS", "Fault", "FaultyBackend", "InjectedStepError", "LoadHold", "StepFault", "parse_fault"]
