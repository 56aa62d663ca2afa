"""ReferenceBackend: a transformers model behind the engine server, with continuous batching.

One scheduler task owns the running batch. Each iteration it reaps aborted states, admits waiting states up to
`max_running` (highest `priority` first, FCFS among equals; prefilled unpadded, batched by equal cached and uncached
lengths), runs one batched decode step for the rows already running, samples every row and applies the tokens on the
event loop (stop checks, finishes). States join and leave between steps. The torch work of an iteration runs in a
worker thread so the event loop (HTTP) stays responsive; everything else (queues, GenStates) is loop-only.

Prefix cache (engine/server/prefix_cache.py): an admitted state prefills only what the cache lacks of its
prompt + output (at least one token is computed, as SGLang), and its prompt's KV is cached right after, so the
samples of a group admitted in the same iteration share the first one's prefill. A row leaving the batch (finished,
aborted, retracted) caches prompt + output, so the next turn of a conversation reuses the earlier ones.

Shared-prefix decode (with the cache and SDPA): the model runs kv_batch's CASCADE attention, and rows that share a
cached prefix (the samples of a group; `_share`) keep one copy of its KV, which their decode steps attend to in one
batched op, merged exactly with each row's own suffix. Samples whose whole prompt but its last token is cached are
prefilled the same way (`prefill_last`), without copying the prefix. Without the cache nothing is shared.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import torch  # ImportError here tells `rollq engine --backend reference` that torch/transformers are missing
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, GenerationConfig

from rollq.engine.images import DEFAULT_MAX_PIXELS, vision_token_ids
from rollq.engine.models import model_dir
from rollq.engine.server.backend import Backend, GenState, ModelRefused, stop_check
from rollq.engine.server.kv_batch import (
    ADAPTER_KEY_SPACE,
    CASCADE,
    KVBatch,
    Prefilled,
    SharedPrefix,
    prefill,
    prefill_last,
    prefill_vision,
)
from rollq.engine.server.lora_registry import AdapterRef
from rollq.engine.server.lora_slots import AdapterSlots
from rollq.engine.server.prefix_cache import PrefixCache, common_prefix
from rollq.engine.server.sampler import RowSpec, request_key, sample
from rollq.engine.server.self_check import (
    check_cascade,
    check_plain,
    probe_ids,
    reference_logprobs,
    sliding_window,
    tolerance,
)
from rollq.engine.server.vision import ImageInputs, ImageRequestError, PreparedImages
from rollq.engine.server.weights import copy_into, load_into, served_parameters
from rollq.engine.types import FinishReason, PauseMode
from rollq.protocol.media import ImageFile

log = logging.getLogger(__name__)

POLL_S = 0.02  # how often a paused scheduler looks for aborted states (the server sets abort_message directly)
THROUGHPUT_WINDOW_S = 10.0
PREFILL_BATCH_ROWS = 64  # sequences per batched prefill forward
PREFILL_BATCH_TOKENS = 8192  # and computed tokens per forward (bounds its activations)
IN_BATCH_PREFIX_MIN = 32  # a sequence waits a wave for another admitted with it that shares this many more tokens
SHARED_PREFIX_MIN = 32  # decode rows share one copy of a prefix's KV (cascade attention) from this many tokens
SHARED_SAVING_MIN = 256  # and when sharing it saves reading this many K/V tokens per step (below, the extra op costs)


class ReferenceConfig(msgspec.Struct, kw_only=True, frozen=True):
    model: str = "tiny"  # "tiny" / "smollm2" (built offline into the cache dir) or a path to an HF model directory
    device: str = "cpu"
    dtype: str = "float32"
    max_running: int = 64  # batch cap; more states wait in the queue
    context_length: int = 0  # 0: the model config's max_position_embeddings
    seed: int = 0  # sampling seed, combined with each rid
    torch_threads: int = 0  # 0: leave one core to the event loop when there are few cores
    # "auto": SDPA where the model supports it (with shared-prefix decode when the prefix cache is on), else eager;
    # "sdpa" / "eager": that one (a model it cannot serve is refused at start)
    attn_implementation: str = "auto"
    prefix_cache_tokens: int = 32768  # KV of this many tokens kept for prefix reuse (LRU); 0 disables the cache
    max_loras_per_batch: int = 8  # distinct LoRA adapters in the running batch, the base model counting as one
    max_image_pixels: int = DEFAULT_MAX_PIXELS  # a vision model's largest image (read from its header first)


class _Req:
    __slots__ = ("state", "done", "key", "prefilled", "cacheable")

    @property
    def has_images(self) -> bool:
        return self.state.vision is not None

    def __init__(self, state: GenState, done: asyncio.Future[None], key: int) -> None:
        self.state = state
        self.done = done
        self.key = key  # sampling: the request's random key (engine/server/sampler.py)
        self.prefilled = False  # cached_tokens is counted at the first prefill only (not after a retract)
        self.cacheable = True  # False: its row's KV predates a flush and must not go back into the cache


class ReferenceBackend(Backend):
    def __init__(self, config: ReferenceConfig | None = None) -> None:
        self.config = config or ReferenceConfig()
        self.served_dtype = self.config.dtype
        self.model: Any = None
        self.tokenizer: Any = None
        self._waiting: collections.deque[_Req] = collections.deque()
        self._running: list[_Req] = []  # row i of the KV batch
        self._batch: Any = None
        self._lock = asyncio.Lock()  # held by each scheduler iteration, by pause and by load_weights
        self._wake = asyncio.Event()
        self._paused = False
        self._task: asyncio.Task[None] | None = None
        self._generated: collections.deque[tuple[float, int]] = collections.deque()
        self._cache = PrefixCache(self.config.prefix_cache_tokens)
        self._prefix_window: collections.deque[tuple[float, int, int]] = collections.deque()  # (t, prompt, cached)
        self._totals = {"prompt_tokens": 0, "cached_tokens": 0, "prefill_tokens": 0, "generated_tokens": 0}
        self.base: Any = None  # the transformers model; `model` is it, or peft's wrapper once adapters were loaded
        self._slots: Any = None  # the LoRA adapters (engine/server/lora_slots.py), set up with the model
        self._images: ImageInputs | None = None  # a vision-language model's image inputs
        self._never_sampled: torch.Tensor | None = None  # token ids no row may sample (vision_token_ids)
        self.attention = ""  # the attention it serves with, once loaded: CASCADE, "sdpa", "eager", ...

    # ---- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._task = asyncio.create_task(self._schedule(), name="reference-scheduler")

    def _load(self) -> None:
        cfg = self.config
        threads = cfg.torch_threads or max(1, min(8, (os.cpu_count() or 2) - 1))
        torch.set_num_threads(threads)
        path = model_dir(cfg.model)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model_config = AutoConfig.from_pretrained(path, local_files_only=True)
        vision = getattr(model_config, "vision_config", None) is not None
        if vision:  # a vision-language model (Qwen2-VL family): images through its own processor (vision.py)
            from rollq.engine.tiny_vlm import load_processor

            self._images = ImageInputs(load_processor(path), int(model_config.image_token_id), cfg.max_image_pixels)
            self.supports_images = True
            self._never_sampled = torch.tensor(vision_token_ids(model_config))
        model_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        self.model = self._load_model(model_class, path)
        self.model.requires_grad_(False)
        self.base = self.model
        self._slots = AdapterSlots(self.model, cfg.device, getattr(torch, cfg.dtype))
        self.model_path = str(path)
        self.vocab_size = int(self.model.config.get_text_config().vocab_size)
        self.context_length = self._context(self.model)
        eos: set[int] = set()
        for source in (self.model.config.get_text_config(), self._generation_config(path)):
            ids = getattr(source, "eos_token_id", None)
            eos.update([ids] if isinstance(ids, int) else ids or [])
        if not eos and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._batch = KVBatch(cascade=self.attention == CASCADE)

    def _load_model(self, model_class: Any, path: Path) -> Any:
        """The model, with the attention that serves it right (`attn_implementation`), checked (self_check.py).

        "auto" takes what transformers picks for the model (SDPA where the model supports it, else eager: Gemma 2's
        softcapping), and with the prefix cache on turns SDPA into the cascade, rows sharing a cached prefix
        decoding against one copy of its KV; a model the cascade does not serve right (its attention does what the
        cascade does not, or the check disagrees) keeps plain SDPA, with a warning that says why. A model whose
        plain paths disagree with its own forward pass is refused."""
        cfg = self.config
        wanted = None if cfg.attn_implementation == "auto" else cfg.attn_implementation
        try:
            model = model_class.from_pretrained(
                path, dtype=getattr(torch, cfg.dtype), local_files_only=True, attn_implementation=wanted
            )
        except ValueError as exc:
            if wanted is None or "does not support" not in str(exc):
                raise
            reason = str(exc).split(". ")[0]  # transformers' first sentence names the model and what it lacks
            raise ModelRefused(
                f"attn_implementation {wanted!r} cannot serve {path}: {reason} (auto picks one that can)"
            ) from None
        model = model.to(cfg.device).eval()
        name = type(model).__name__
        self.attention = model.config._attn_implementation
        vocab = int(model.config.get_text_config().vocab_size)
        avoid = self._never_sampled.tolist() if self._never_sampled is not None else ()
        ids = probe_ids(vocab, self._context(model), sliding_window(model), avoid)
        tol = tolerance(getattr(torch, cfg.dtype))
        with torch.inference_mode():
            reference, wrong = reference_logprobs(model, ids)  # one plain forward, with the model's own attention
            if wrong is None:
                wrong = check_plain(model, ids, reference, tol)
            if wrong is not None:
                raise ModelRefused(f"{name} cannot be served by the reference engine with {self.attention}: {wrong}")
            if self.attention == "sdpa" and cfg.prefix_cache_tokens > 0:
                model.set_attn_implementation(CASCADE)
                wrong = check_cascade(model, ids, reference, tol)
                if wrong is None:
                    self.attention = CASCADE
                else:
                    model.set_attn_implementation("sdpa")
                    log.warning("%s is served without shared-prefix decode: %s", name, wrong)
        sharing = "with shared-prefix decode" if self.attention == CASCADE else "without shared-prefix decode"
        cache = sharing if cfg.prefix_cache_tokens > 0 else "no prefix cache"
        log.info("%s passed the start-up check: %s attention, %s", name, model.config._attn_implementation, cache)
        return model

    def _context(self, model: Any) -> int:
        if self.config.context_length:
            return self.config.context_length
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if context is None:  # e.g. a recurrent model
            raise ModelRefused(f"{type(model).__name__} names no context length (max_position_embeddings)")
        return int(context)

    @staticmethod
    def _generation_config(path: Path) -> GenerationConfig | None:
        try:
            return GenerationConfig.from_pretrained(path, local_files_only=True)
        except OSError:  # no generation_config.json
            return None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in [*self._running, *self._waiting]:
            self._finish(req, FinishReason(type="abort", message="engine shut down"))
        self._running.clear()
        self._waiting.clear()
        if self._batch is not None:
            self._batch.clear()

    # ---- the Backend contract --------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prepare_images(self, input_ids: list[int], images: list[ImageFile]) -> tuple[list[int], Any]:
        if self._images is None:
            raise ImageRequestError(f"this engine's model ({self.model_path}) takes no image input")
        if not images:
            self._images.check_no_placeholders(input_ids)
            return input_ids, None
        ids, prepared = self._images.prepare(input_ids, images)
        if len(ids) >= self.context_length:
            raise ImageRequestError(
                f"The input ({len(ids)} tokens with its images) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )
        return ids, prepared

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    async def run(self, state: GenState) -> None:
        if self._task is None:
            raise RuntimeError("ReferenceBackend.run before start()")
        n = len(state.input_ids) + len(state.output_ids)
        if n >= self.context_length:
            raise ValueError(
                f"The input ({n} tokens) is longer than the model's context length ({self.context_length} tokens)."
            )
        if state.params.max_new_tokens <= len(state.output_ids):
            state.finish = FinishReason(type="length", length=len(state.output_ids))
            return
        if state.vision is not None and state.adapter is not None:
            raise ValueError("a request with images cannot name a LoRA adapter on this engine")
        req = _Req(state, asyncio.get_running_loop().create_future(), request_key(self.config.seed, state.rid))
        self._enqueue(req)
        self._wake.set()
        try:
            await asyncio.shield(req.done)
        except asyncio.CancelledError:
            # The caller went away: let the scheduler drop the state at its next look.
            if state.finish is None and state.abort_message is None:
                state.abort_message = "request cancelled"
            self._wake.set()
            raise

    async def pause(self, mode: PauseMode) -> None:
        self._paused = True
        async with self._lock:  # waits for the iteration in flight
            if mode == "retract":
                # Running states go back to the queue head, in order; resume re-prefills prompt + partial output
                # (mostly from the prefix cache, which gets every row's KV before the batch is freed).
                await asyncio.to_thread(self._retire, self._rows_leaving(range(len(self._running))), self._cache.epoch)
                self._waiting.extendleft(reversed([r for r in self._running if r.state.finish is None]))
                self._running.clear()
                self._batch.clear()

    async def resume(self) -> None:
        self._paused = False
        self._wake.set()

    async def load_weights(self, path: str) -> None:
        # The prefix cache is kept: the server flushes it when the update asks (SGLang's flush_cache flag). With
        # adapters loaded the base weights change under them (weights.served_parameters names them).
        async with self._lock:
            await asyncio.to_thread(load_into, self.model, path)

    async def load_tensors(self, named: list[tuple[str, Any]], *, adopt: bool = False) -> None:
        # Any subset of the parameters, as SGLang's update_weights_from_distributed loads whatever names a call
        # carries (model_runner.py:1082-1118 in 0.5.5: receive each, then model.load_weights): trainers send large
        # models in buckets, one call each, while the engine stays paused.
        async with self._lock:
            await asyncio.to_thread(copy_into, self.model, dict(named), partial=True, adopt=adopt)

    holds_weights = True

    def served_weights(self) -> dict[str, Any]:
        # Adapters loaded or not: the base weights under their own names (a delta or a checksum never sees a LoRA
        # tensor, and copying a delta in leaves the adapters as they are).
        return served_parameters(self.model)

    supports_lora = True

    async def load_adapter(self, ref: AdapterRef, path: str) -> None:
        """The adapter joins the model between two scheduler iterations (engine/server/lora_slots.py), so no step
        runs with half of it; requests already running go on as they were."""
        from peft import LoraConfig

        config = await asyncio.to_thread(LoraConfig.from_pretrained, path)
        if str(getattr(config.peft_type, "value", config.peft_type)) != "LORA":
            raise ValueError(f"{path} is not a LoRA adapter (peft_type {config.peft_type})")
        async with self._lock:
            await asyncio.to_thread(self._slots.load, ref.id, path, config)
            self.model = self._slots.model

    async def unload_adapter(self, ref: AdapterRef) -> None:
        async with self._lock:
            await asyncio.to_thread(self._slots.unload, ref.id)
            self.model, self.base = self._slots.model, self._slots.base
        # Its KV lives on in the prefix cache under its own keys (_keys): never matched again, evicted as LRU.

    def _adapter_names(self, reqs: Iterable[_Req]) -> list[str] | None:
        """peft's per-row adapter names (None when no adapter was loaded: a plain forward)."""
        return self._slots.names([r.state.adapter.id if r.state.adapter else None for r in reqs])

    @staticmethod
    def _keys(req: _Req) -> list[int]:
        """The ids under which a state's KV is cached and shared: its tokens, moved into a range of their own for
        each adapter (SGLang adds the lora id to the radix cache's key, schedule_batch.py:501-508), so KV computed
        with one adapter never serves another or the base model."""
        ids = [*req.state.input_ids, *req.state.output_ids]
        if req.state.adapter is None:
            return ids
        offset = req.state.adapter.id * ADAPTER_KEY_SPACE
        return [t + offset for t in ids]

    def flush_cache(self) -> None:
        # Rows still in the batch (finished ones are retired at the next iteration) hold KV of the old weights.
        for req in self._running:
            req.cacheable = False
        self._cache.clear()

    def stats(self) -> dict[str, float]:
        now = time.monotonic()
        while self._generated and self._generated[0][0] < now - THROUGHPUT_WINDOW_S:
            self._generated.popleft()
        tokens = sum(n for _, n in self._generated)
        span = max(1e-3, min(THROUGHPUT_WINDOW_S, now - self._generated[0][0])) if self._generated else 1.0
        capacity = self.config.max_running * max(1, self.context_length)
        cached = self._batch.tokens() if self._batch is not None else 0
        while self._prefix_window and self._prefix_window[0][0] < now - THROUGHPUT_WINDOW_S:
            self._prefix_window.popleft()
        prompt = sum(p for _, p, _ in self._prefix_window)
        hit = sum(c for _, _, c in self._prefix_window)
        return {
            "num_running_reqs": float(sum(r.state.finish is None for r in self._running)),
            "num_queue_reqs": float(len(self._waiting)),
            "token_usage": cached / capacity,
            "gen_throughput": tokens / span,
            "cache_hit_rate": hit / prompt if prompt else 0.0,  # prompt tokens reused, over the recent window
            "prefix_cache_tokens": float(self._cache.tokens),
            "prompt_tokens_total": float(self._totals["prompt_tokens"]),
            "cached_tokens_total": float(self._totals["cached_tokens"]),
            "prefill_tokens_total": float(self._totals["prefill_tokens"]),  # tokens actually computed by prefills
            "generated_tokens_total": float(self._totals["generated_tokens"]),  # tokens sampled into outputs
        }

    # ---- scheduler -------------------------------------------------------------------------------------------

    async def _schedule(self) -> None:
        while True:
            async with self._lock:
                self._reap_aborted()
                busy = not self._paused and bool(self._waiting or self._unfinished())
                if busy or (not self._paused and self._running):
                    await self._iterate()  # when all finished: caches their KV and frees the batch now
            if busy:
                await asyncio.sleep(0)  # let pause/load_weights/new requests in between iterations
                continue
            self._wake.clear()
            pending = bool(self._waiting or self._unfinished())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_S if pending else None)

    def _enqueue(self, req: _Req) -> None:
        """Insert behind every waiting state of the same or a higher priority (larger first, FCFS among equals)."""
        prio = req.state.priority or 0
        i = len(self._waiting)
        while i > 0 and (self._waiting[i - 1].state.priority or 0) < prio:
            i -= 1
        self._waiting.insert(i, req)

    def _unfinished(self) -> bool:
        return any(r.state.finish is None for r in self._running)

    def _reap_aborted(self) -> None:
        for req in [r for r in self._waiting if r.state.abort_message is not None]:
            self._waiting.remove(req)
            self._finish(req, FinishReason(type="abort", message=req.state.abort_message))
        for req in self._running:
            if req.state.finish is None and req.state.abort_message is not None:
                self._finish(req, FinishReason(type="abort", message=req.state.abort_message))

    async def _iterate(self) -> None:
        keep = [i for i, r in enumerate(self._running) if r.state.finish is None]
        leaving = self._rows_leaving(i for i, r in enumerate(self._running) if r.state.finish is not None)
        running = [self._running[i] for i in keep]
        admit: list[_Req] = []
        # SGLang stops admitting once one more adapter would exceed max_loras_per_batch (scheduler.py:1763-1776)
        in_batch = {r.state.adapter.id if r.state.adapter else 0 for r in running}
        while self._waiting and len(running) + len(admit) < self.config.max_running:
            adapter = self._waiting[0].state.adapter
            key = adapter.id if adapter else 0
            if key not in in_batch and len(in_batch) >= self.config.max_loras_per_batch:
                break
            in_batch.add(key)
            admit.append(self._waiting.popleft())
            # prefilled afresh; a row with images is never cached: its image tokens' ids are the same for any image
            admit[-1].cacheable = not admit[-1].has_images
        admit.sort(key=lambda r: r.has_images)  # rows with images are prefilled one by one, after the rest
        # Snapshot what the thread reads, so the loop may go on mutating states meanwhile.
        decode_tokens = [r.state.output_ids[-1] for r in running]
        prefill_ids = [self._keys(r) for r in admit]  # cache keys; the model gets the tokens (_tokens)
        with_images = [r.state.vision for r in admit if r.has_images]
        adapters = self._adapter_names([*running, *admit])
        rows = [self._row_spec(r) for r in (*running, *admit)]
        self._running = running + admit
        epoch = self._cache.epoch  # a flush while the step runs voids what it would cache
        try:
            tokens, logprobs, reused = await asyncio.to_thread(
                self._step, epoch, leaving, keep, decode_tokens, prefill_ids, rows, adapters, with_images
            )
        except Exception as e:
            log.exception("reference engine step failed; aborting the running batch")
            for req in self._running:
                self._finish(
                    req,
                    FinishReason(
                        type="abort", message=f"engine error: {e!r}", status_code=500, err_type=type(e).__name__
                    ),
                )
            self._running.clear()
            self._batch.clear()
            return
        self._count_prefills(admit, prefill_ids, reused)
        self._apply(tokens, logprobs)

    def _rows_leaving(self, rows: Iterable[int]) -> list[tuple[int, list[int]]]:
        """(batch row, its tokens) for rows whose KV goes to the prefix cache when they leave the batch."""
        if self.config.prefix_cache_tokens <= 0:
            return []
        reqs = [(i, self._running[i]) for i in rows]
        return [(i, self._keys(r)) for i, r in reqs if r.cacheable]

    def _retire(self, rows: list[tuple[int, list[int]]], epoch: int) -> None:
        """Cache the KV of rows about to leave the batch (worker thread). A row holds KV for all its tokens but the
        last sampled one (never fed), or for all of them when it was aborted while a step ran: its length says."""
        with torch.inference_mode():  # as _step: the cache holds inference tensors only
            for i, ids in rows:
                n, start, own = self._batch.own(i)  # a shared prefix is cached already, mostly: no concatenation then
                if not self._cache.insert(ids[:n], own, epoch, kv_start=start):
                    self._cache.insert(ids[:n], self._batch.row(i)[1], epoch)

    def _step(
        self,
        epoch: int,
        leaving: list[tuple[int, list[int]]],
        keep: list[int],
        decode_tokens: list[int],
        prefill_ids: list[list[int]],
        rows: list[Any],
        adapters: list[str] | None = None,
        with_images: list[PreparedImages] | None = None,
    ) -> tuple[list[int], list[float], list[int]]:
        """One iteration's torch work (worker thread); `adapters`: each row's (running, then admitted), or None;
        `with_images`: the images of the last admitted rows (after those without)."""
        n = len(decode_tokens)
        with_images = with_images or []
        text_ids = prefill_ids[: len(prefill_ids) - len(with_images)]
        with torch.inference_mode():
            self._retire(leaving, epoch)
            self._batch.keep(keep)
            parts = [self._batch.decode(self.model, decode_tokens, adapters and adapters[:n])] if decode_tokens else []
            seqs, reused = self._prefill(text_ids, epoch, adapters[n : n + len(text_ids)] if adapters else None)
            shared = self._share(text_ids, seqs, epoch)
            seqs += self._prefill_vision(prefill_ids[len(text_ids) :], with_images)
            shared += [None] * len(with_images)
            reused += [0] * len(with_images)
            parts += [s.logits[None] for s in seqs]
            self._batch.add(seqs, shared)
            if not parts:  # nothing runs: rows only left the batch
                return [], [], []
            logits = torch.cat(parts)
            if self._never_sampled is not None:
                logits[:, self._never_sampled] = float("-inf")
            tokens, logprobs = sample(logits, rows)
            return tokens, logprobs, reused

    def _prefill_vision(self, ids: list[list[int]], images: list[PreparedImages]) -> list[Prefilled]:
        """Prefill the admitted rows with images (worker thread), batched by length (the samples of a group, or the
        prompts of a task, have one); in order."""
        out: list[Prefilled | None] = [None] * len(ids)
        by_length: dict[int, list[int]] = {}
        for i, x in enumerate(ids):
            by_length.setdefault(len(x), []).append(i)
        for length, members in by_length.items():
            rows = max(1, min(PREFILL_BATCH_ROWS, PREFILL_BATCH_TOKENS // length))
            for c in range(0, len(members), rows):
                chunk = members[c : c + rows]
                done = prefill_vision(
                    self.model,
                    [ids[i] for i in chunk],
                    [images[i].pixel_values for i in chunk],
                    [images[i].image_grid_thw for i in chunk],
                    [images[i].token_types(length) for i in chunk],
                )
                for i, seq in zip(chunk, done, strict=True):
                    out[i] = seq
        return [s for s in out if s is not None]

    def _prefill(
        self, prefill_ids: list[list[int]], epoch: int, adapters: list[str] | None = None
    ) -> tuple[list[Prefilled], list[int]]:
        """Prefill the admitted sequences (worker thread); returns them in order, and the tokens each reused.

        At most len-1 tokens are reused: the last one's logits are needed. Sequences with equal cached and uncached
        lengths run as one batch. A sequence that shares more with another one of this iteration than the cache
        holds (the samples of a group) waits for that one's prefill, which caches its tokens right after: in waves,
        the first of such a set (lexicographically) is computed, the others match it in the next wave."""
        use_cache = self.config.prefix_cache_tokens > 0
        out: list[Prefilled | None] = [None] * len(prefill_ids)
        reused = [0] * len(prefill_ids)
        pending = list(range(len(prefill_ids)))
        defer = use_cache
        while pending:
            now, later = self._defer(pending, prefill_ids) if defer else (pending, [])
            held = {i: self._cache.peek(prefill_ids[i][:-1]) for i in later}
            matches = {i: self._cache.match(prefill_ids[i][:-1]) if use_cache else (0, None) for i in now}
            groups: dict[tuple[int, int], list[int]] = {}
            for i in now:
                groups.setdefault((matches[i][0], len(prefill_ids[i])), []).append(i)
            for (start, length), members in groups.items():
                rows = max(1, min(PREFILL_BATCH_ROWS, PREFILL_BATCH_TOKENS // (length - start)))
                for c in range(0, len(members), rows):
                    chunk = members[c : c + rows]
                    shared = self._last_token_rows(chunk, prefill_ids, start, length, epoch)
                    plain = [i for i in chunk if i not in shared]
                    done: list[Prefilled] = []
                    if shared:
                        ids = [prefill_ids[i] for i in shared]
                        prefixes = self._prefixes(ids, [matches[i] for i in shared], epoch)
                        done += prefill_last(self.model, ids, prefixes, _of(adapters, shared))
                    if plain:
                        ids = [prefill_ids[i] for i in plain]
                        cached = [matches[i][1] for i in plain] if start else None
                        done += prefill(self.model, ids, cached, _of(adapters, plain))
                    chunk = [*shared, *plain]
                    for i, seq in zip(chunk, done, strict=True):
                        start_kv = seq.shared.length if seq.shared is not None else 0
                        if not self._cache.insert(prefill_ids[i], seq.layers, epoch, kv_start=start_kv):
                            self._cache.insert(prefill_ids[i], seq.full_layers(), epoch)  # its prefix was evicted
                        out[i], reused[i] = seq, start
            # Waiting pays only when the wave just run cached more of the waiting ones (a prompt longer than the
            # cache's budget, or evicted at once, never gets there): else the rest goes in one batch.
            defer = any(self._cache.peek(prefill_ids[i][:-1]) > n for i, n in held.items())
            pending = later
        return [s for s in out if s is not None], reused

    def _last_token_rows(
        self, chunk: list[int], prefill_ids: list[list[int]], start: int, length: int, epoch: int
    ) -> list[int]:
        """Those of `chunk` (sequences with `start` tokens cached) to prefill against their cached prefix shared
        (`prefill_last`): cascade batches, only the last token to compute, and a prefix of SHARED_PREFIX_MIN tokens
        that enough others of them have too (SHARED_SAVING_MIN), or a running row has."""
        if not self._batch.cascade or length - start != 1 or start < SHARED_PREFIX_MIN:
            return []
        keys = {i: tuple(prefill_ids[i][:start]) for i in chunk}
        counts = collections.Counter(keys.values())
        live = self._batch.prefixes(epoch)
        return [i for i in chunk if (counts[keys[i]] - 1) * start >= SHARED_SAVING_MIN or keys[i] in live]

    def _prefixes(self, ids: list[list[int]], matches: list[tuple[int, Any]], epoch: int) -> list[SharedPrefix]:
        """One SharedPrefix per distinct cached prefix of `ids` (of the batch's, when a running row has it and it
        was computed since the last flush)."""
        known = self._batch.prefixes(epoch)
        out = []
        for x, (n, kv) in zip(ids, matches, strict=True):
            key = tuple(x[:n])
            if key not in known:
                known[key] = SharedPrefix(key, kv, epoch)
            out.append(known[key])
        return out

    def _share(self, prefill_ids: list[list[int]], seqs: list[Prefilled], epoch: int) -> list[SharedPrefix | None]:
        """The prefix each admitted sequence shares with other rows in its decode steps (cascade batches only): a
        prefix of a row already running, else the longest prefix it has in common with another sequence admitted
        with it (its lexicographic neighbours), of at least SHARED_PREFIX_MIN tokens and short of its last token, when
        the group saves at least SHARED_SAVING_MIN K/V tokens per step.
        The prefix's KV is copied from the first sequence that has it: the rows' own KVs of it are equal (they come
        from the cache), up to rounding when some row computed it."""
        if not self._batch.cascade or not seqs:
            return [None] * len(seqs)
        live = self._batch.prefixes(epoch)  # not those of rows prefilled before a flush (older weights)
        live.update((s.shared.key, s.shared) for s in seqs if s.shared is not None)  # cascade-prefilled rows
        lengths = sorted({len(k) for k in live}, reverse=True)
        best = [0] * len(prefill_ids)
        order = sorted(range(len(prefill_ids)), key=lambda i: prefill_ids[i])
        for a, b in zip(order, order[1:], strict=False):
            n = common_prefix(prefill_ids[a], prefill_ids[b])
            best[a], best[b] = max(best[a], n), max(best[b], n)
        keys: list[tuple[int, ...] | None] = []
        for i, ids in enumerate(prefill_ids):
            cap = len(ids) - 1
            key = next((k for n in lengths if n <= cap and (k := tuple(ids[:n])) in live), None)
            if key is None and min(best[i], cap) >= SHARED_PREFIX_MIN:
                key = tuple(ids[: min(best[i], cap)])
            keys.append(key)
        counts = collections.Counter(keys)
        made: dict[tuple[int, ...], SharedPrefix] = {}
        out: list[SharedPrefix | None] = []
        for key, seq in zip(keys, seqs, strict=True):
            if seq.shared is not None:  # prefilled against its prefix: keeps it
                out.append(seq.shared)
                continue
            if key is None or (key not in live and (counts[key] - 1) * len(key) < SHARED_SAVING_MIN):  # not worth it
                out.append(None)
                continue
            if key not in live and key not in made:
                n = len(key)
                layers = [(k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in seq.layers]
                made[key] = SharedPrefix(key, layers, epoch)
            out.append(live.get(key) or made[key])
        return out

    def _defer(self, pending: list[int], prefill_ids: list[list[int]]) -> tuple[list[int], list[int]]:
        """Split `pending` into (prefill now, wait a wave): a sequence waits when its lexicographic predecessor among
        `pending` shares enough more of it than the cache holds (SGLang's in-batch prefix caching)."""
        order = sorted(pending, key=lambda i: prefill_ids[i])
        wait = set()
        for prev, cur in zip(order, order[1:], strict=False):
            ids = prefill_ids[cur]
            shared = min(common_prefix(prefill_ids[prev], ids), len(ids) - 1)
            if shared <= 0:
                continue
            have = self._cache.peek(ids[:-1])
            if shared - have >= max(1, min(IN_BATCH_PREFIX_MIN, len(ids) - 1 - have)):  # 0: cached already
                wait.add(cur)
        return [i for i in pending if i not in wait], [i for i in pending if i in wait]

    def _count_prefills(self, admit: list[_Req], prefill_ids: list[list[int]], reused: list[int]) -> None:
        now = time.monotonic()
        for req, ids, n in zip(admit, prefill_ids, reused, strict=True):
            self._totals["prefill_tokens"] += len(ids) - n
            if req.prefilled:  # a retracted state's re-prefill: not a prompt cache hit (as SGLang)
                continue
            req.prefilled = True
            prompt = len(req.state.input_ids)
            req.state.cached_tokens = min(n, prompt)
            self._totals["prompt_tokens"] += prompt
            self._totals["cached_tokens"] += req.state.cached_tokens
            self._prefix_window.append((now, prompt, req.state.cached_tokens))

    def _apply(self, tokens: list[int], logprobs: list[float]) -> None:
        if not tokens:
            return
        now = time.monotonic()
        for req, token, logprob in zip(self._running, tokens, logprobs, strict=True):
            state = req.state
            if state.finish is not None:  # finished (aborted) while the step ran: keep what it had
                continue
            state.output_ids.append(token)
            self._totals["generated_tokens"] += 1
            if state.return_logprob:
                state.output_logprobs.append(logprob)
            if state.first_token_at is None:
                state.first_token_at = now
            finish = stop_check(state, token, self.eos_token_ids, self._decode_for_stop)
            if finish is None and len(state.input_ids) + len(state.output_ids) >= self.context_length:
                finish = FinishReason(type="length", length=len(state.output_ids))
            if finish is not None:
                self._finish(req, finish)
        self._generated.append((now, len(tokens)))

    def _decode_for_stop(self, ids: list[int]) -> str:
        # as SGLang's check_finished: stop strings match the raw tail, special tokens included
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _row_spec(self, req: _Req) -> RowSpec:
        state, p = req.state, req.state.params
        penalised = p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0
        output = list(state.output_ids) if penalised else []  # a snapshot only when the sampler reads it
        return RowSpec(p, output, req.key, self._min_new_stop_ids(state), len(state.output_ids))

    def _min_new_stop_ids(self, state: GenState) -> list[int]:
        p = state.params
        if p.min_new_tokens <= len(state.output_ids):
            return []
        return [*([] if p.ignore_eos else self.eos_token_ids), *(p.stop_token_ids or [])]

    @staticmethod
    def _finish(req: _Req, reason: FinishReason) -> None:
        if req.state.finish is None:
            req.state.finish = reason
        if not req.done.done():
            req.done.set_result(None)


def _of(adapters: list[str] | None, rows: list[int]) -> list[str] | None:
    """The adapters of `rows` (indices into the admitted sequences), or None (no adapter loaded)."""
    return None if adapters is None else [adapters[i] for i in rows]
