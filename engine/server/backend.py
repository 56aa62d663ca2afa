"""What an engine server needs from a model backend. The server (engine/server/app.py) owns HTTP, validation, rids,
the pause gate and aborts; a backend only turns GenStates into tokens.

Contract:
- `run(state)` generates until the state finishes: it appends to `state.output_ids` / `state.output_logprobs`
  (the model's log-probability of each sampled token, log_softmax of the raw logits, as SGLang reports it) and sets
  `state.finish` before returning. Between decode steps it checks `state.abort_message`; when set it stops
  and sets `FinishReason(type="abort", message=state.abort_message)`, keeping the tokens made so far.
- `pause("in_place")` freezes decoding (KV caches kept) until `resume()`; `pause("retract")` frees the KV caches of
  running states and, after `resume()`, recomputes prompt + partial output and goes on (no token lost or repeated).
  `pause("abort")` is handled by the server (it sets abort_message on every state); backends treat it like in_place.
- `load_weights(path)` / `load_tensors(named)` replace the weights (called by the server only while no decode step
  runs). Loading never touches the prefix cache: the server calls `flush_cache()` when the update asks for it, as
  SGLang does (weight_updater.py:119-133 in 0.5.23), so `flush_cache: false` keeps KV computed by the old weights.
- `flush_cache()` drops every cached prefix; the server calls it only when no state holds KV in the running batch.
- `state.priority` (SGLang's request priority, larger first) orders the waiting queue of a backend that has one;
  `state.cached_tokens` is set by a backend with a prefix cache: prompt tokens whose KV was reused.
- `load_adapter(ref, path)` / `unload_adapter(ref)` (backends with `supports_lora`): a LoRA adapter in PEFT's format
  joins or leaves the model; `state.adapter` names the one a state generates with (None: the base model), and a
  batch may mix them. The server unloads an adapter only once no state uses it (engine/server/lora_registry.py).
- `served_weights()` (backends with `holds_weights`): the served parameters by the names of the model's own files
  (weights.served_parameters), the tensors themselves, not copies: the server reads them (weight deltas, checksums)
  only while no load runs (engine/server/delta_routes.py). `served_dtype` is the dtype they are served in.
- `stop_check(state, token_id)` below decides stop/length finishes the same way for every backend.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Mapping
from typing import Any

from rollq.engine.server.lora_registry import AdapterRef
from rollq.engine.types import FinishReason, PauseMode, SamplingParams
from rollq.protocol.media import ImageFile


class ModelRefused(ValueError):
    """A backend cannot serve its model right, found when it starts; the message says what is missing."""


class GenState:
    """One sample being generated. Mutable; shared by the server and the backend (same event loop)."""

    __slots__ = (
        "rid",
        "input_ids",
        "params",
        "return_logprob",
        "output_ids",
        "output_logprobs",
        "finish",
        "abort_message",
        "created",
        "first_token_at",
        "weight_version_start",
        "priority",
        "cached_tokens",
        "adapter",
        "images",
        "vision",
    )

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        return_logprob: bool = False,
        priority: int | None = None,
        adapter: AdapterRef | None = None,
    ) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.params = params
        self.return_logprob = return_logprob
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.finish: FinishReason | None = None
        self.abort_message: str | None = None
        self.created = time.monotonic()
        self.first_token_at: float | None = None
        self.weight_version_start: str | None = None
        self.priority = priority
        self.cached_tokens = 0
        self.adapter = adapter  # the LoRA adapter it generates with (None: the base model)
        self.images: list[ImageFile] = []  # its image_data, loaded (backends with `supports_images`)
        self.vision: Any = None  # the backend's model inputs of those images (Backend.prepare_images)


def stop_check(
    state: GenState, token_id: int, eos_token_ids: frozenset[int], decode: Any = None
) -> FinishReason | None:
    """Call after appending `token_id` to `state.output_ids`. Returns the finish reason, or None to go on.
    `decode(ids) -> str` is needed only for stop strings."""
    p = state.params
    produced = len(state.output_ids)
    if produced >= p.min_new_tokens:
        if not p.ignore_eos and token_id in eos_token_ids:
            return FinishReason(type="stop", matched=token_id)
        if p.stop_token_ids and token_id in p.stop_token_ids:
            return FinishReason(type="stop", matched=token_id)
        if p.stop and decode is not None:
            tail = decode(state.output_ids[-32:])
            for s in p.stop:
                if s and tail.endswith(s):
                    return FinishReason(type="stop", matched=s)
    if produced >= p.max_new_tokens:
        return FinishReason(type="length", length=produced)
    return None


class Backend(abc.ABC):
    """A model behind an engine server."""

    model_path: str = ""
    vocab_size: int = 0
    context_length: int = 0
    eos_token_ids: frozenset[int] = frozenset()

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load what must be loaded before serving."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError(f"{type(self).__name__} has no tokenizer")

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no tokenizer")

    def prepare_images(self, input_ids: list[int], images: list[ImageFile]) -> tuple[list[int], Any]:
        """(the prompt as the model takes it with these images, their model inputs for GenState.vision), for a
        backend with `supports_images`; run in a worker thread. A ValueError is the request's 400."""
        return input_ids, None

    @abc.abstractmethod
    async def run(self, state: GenState) -> None:
        """Generate for one state until it finishes (see the module docstring)."""

    @abc.abstractmethod
    async def pause(self, mode: PauseMode) -> None: ...

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def load_weights(self, path: str) -> None: ...

    async def load_tensors(self, named: list[tuple[str, Any]], *, adopt: bool = False) -> None:
        """Copy received (name, torch tensor) pairs into the weights (the distributed update path). `adopt`: the
        tensors are the caller's to give away (a staged weight delta): one that already has its parameter's dtype,
        device and shape becomes the parameter's storage instead of being copied, so a swap costs no copy."""
        raise NotImplementedError(f"{type(self).__name__} cannot load weights from tensors")

    holds_weights = False  # served_weights() works: the engine can prepare weight deltas and report checksums
    served_dtype = "auto"  # the dtype of the served weights (torch's name), as /server_info reports it

    def served_weights(self) -> Mapping[str, Any]:
        """The served parameters by their names in the model's own files (see the module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} holds no weights")

    supports_lora = False  # load_adapter / unload_adapter work (a batch may mix adapters and the base model)
    supports_images = False  # a state's `images` are seen by the model (image_data); without, they are refused

    async def load_adapter(self, ref: AdapterRef, path: str) -> None:
        """Read the PEFT adapter at `path` (already resolved under the weights root) as `ref`."""
        raise NotImplementedError(f"{type(self).__name__} serves no LoRA adapters")

    async def unload_adapter(self, ref: AdapterRef) -> None:
        """Drop `ref` (no state uses it any more)."""
        raise NotImplementedError(f"{type(self).__name__} serves no LoRA adapters")

    def flush_cache(self) -> None:  # noqa: B027 - optional hook: a backend without a prefix cache has nothing to drop
        """Drop every cached prefix (KV computed by the weights it was computed with)."""

    def stats(self) -> dict[str, float]:
        """Gauges for /metrics: at least num_running_reqs, num_queue_reqs, token_usage, gen_throughput."""
        return {}
