"""SGLang's HTTP protocol over any `rollq.engine.server.backend.Backend` (see docs/sglang-protocol.md).

The server owns HTTP, validation, rids, the pause gate, aborts, the model-update lock and weight versions; the
backend only turns GenStates into tokens."""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import aiohttp
import msgspec
from aiohttp import web

from rollq.engine.server.backend import Backend, GenState
from rollq.engine.server.delta_routes import ROUTES_KEY as DELTA_ROUTES_KEY
from rollq.engine.server.delta_routes import add_delta_routes, is_delta_dir
from rollq.engine.server.distributed_routes import add_distributed_routes
from rollq.engine.server.health import GenerationHealth, is_engine_error
from rollq.engine.server.lora_registry import NOT_ENABLED, AdapterError, AdapterRegistry
from rollq.engine.server.lora_routes import ROUTES_KEY as LORA_ROUTES_KEY
from rollq.engine.server.lora_routes import add_lora_routes
from rollq.engine.server.media import MediaPolicy, MediaRefused, load_images
from rollq.engine.server.validation import BadRequest, EngineValueError, GenerateCall, parse_generate
from rollq.engine.server.vision import ImageRequestError
from rollq.engine.server.weights_root import WeightsPathRefused, resolve_under
from rollq.engine.types import ADMIN_ROUTES, FinishReason, PauseMode, SamplingParams
from rollq.http_server import BAD_JSON, read_body, start_site
from rollq.protocol.image_limits import ImageLimitError, ImageTally
from rollq.protocol.media import ImageFile

log = logging.getLogger("rollq.engine")

WAITING_ABORT = "Abort in waiting queue"
_OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # never need a key (utils/auth.py:101-106)
_PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "retract", "in_place")


Compat = Literal["0.5.23", "0.5.5"]


class EngineServerConfig(msgspec.Struct, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 30000  # 0: any free port (see ServerHandle.url)
    api_key: str | None = None
    admin_api_key: str | None = None  # guards the control routes (utils/auth.py:76-150 in 0.5.23)
    # No key at all: control routes answer 403 (`rollq engine` sets it unless insecure_no_auth), so any process of the
    # machine can't pause the engine, load weights or adapters; False (embedded servers, tests): they are open.
    control_closed: bool = False
    # /update_weights_from_disk reads only from under this directory; None: no disk load at all (weights_root.py)
    weights_root: str | None = None
    compat: Compat = "0.5.23"  # "0.5.5": pause takes no mode and always aborts at once; streamed output_ids deltas
    weight_version: str = "default"
    skip_tokenizer_init: bool = False
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    health_timeout_s: float = 20.0
    # Engine errors in a row (no generation succeeding between) that make /health, /health_generate and /ready
    # answer 503, for unhealthy_for_s after the last one, doubled each time it fails again before any success
    # (engine/server/health.py); 0: never
    unhealthy_after_errors: int = 4
    unhealthy_for_s: float = 30.0
    stream_poll_s: float = 0.01  # how often a stream looks for new tokens (the contract has no token callback)
    shutdown_timeout_s: float = 5.0
    # Read timeouts (rollq/http_server.py). The head timeout is also the idle keep-alive timeout: above the engine
    # pool's keep-alive (60 s, engine/http.py), so the pool never reuses a connection the server is closing.
    header_timeout_s: float = 75.0
    body_timeout_s: float = 60.0
    # Largest request body on every route (aiohttp's 413 beyond). /generate is the big one: a long prompt's ids are
    # about 8 bytes a token, so 32 MiB holds a batch of 4M tokens; no route takes tensors over HTTP.
    max_body_bytes: int = 32 << 20
    # LoRA (SGLang's --enable-lora, --max-loras-per-batch, --max-loaded-loras, --lora-paths; engine/server/lora_routes)
    enable_lora: bool = False
    max_loras_per_batch: int = 8  # distinct adapters in one running batch, the base model counting as one
    max_loaded_loras: int | None = None
    lora_paths: list[str] = []  # adapters loaded at start: NAME=PATH or PATH (then named by its path)
    # Where image_data may come from besides the request itself (engine/server/media.py): paths under media_root,
    # URLs of these hosts; neither by default.
    media: MediaPolicy = MediaPolicy()


class _Req:
    """Server-side bookkeeping of one GenState."""

    __slots__ = ("state", "started", "segments", "wake", "retractions", "top_logprobs_num", "abort_sent")

    def __init__(self, state: GenState, top_logprobs_num: int) -> None:
        self.state = state
        self.started = False
        self.segments: list[tuple[str, int]] = []  # (weight version, first output index generated under it)
        self.wake: asyncio.Event | None = None  # set while waiting at the gate
        self.retractions = 0
        self.top_logprobs_num = top_logprobs_num
        self.abort_sent = False


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


def _bad_request(message: str) -> web.Response:
    return _json({"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}, 400)


def _engine_error(message: str, status: int = 400) -> web.Response:
    return _json({"error": {"message": message}}, status)


class EngineServer:
    def __init__(self, backend: Backend, config: EngineServerConfig) -> None:
        self.backend = backend
        self.config = config
        self.weight_version = config.weight_version
        self.phase = "starting"  # starting | ready | closing
        self.states: dict[str, _Req] = {}  # every request in flight (waiting or running), by rid
        self.running = 0
        self.paused = False
        self.pause_mode: PauseMode | None = None
        self._frozen = False  # backend.pause() has returned: no decode step runs until resume
        self._updating = 0
        self._update_lock = asyncio.Lock()
        self._changed = asyncio.Event()  # pulsed when `running` drops to 0 or the pause state changes
        self.started_at = time.time()
        self._media_http: aiohttp.ClientSession | None = None  # fetches image URLs (only with media.url_hosts)
        # sglang:<name>_total counters
        self.counters = {
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "cached_tokens": 0,
            "num_requests": 0,
            "num_aborted_requests": 0,
            "num_retracted_requests": 0,
        }
        self.adapters = AdapterRegistry(config.max_loaded_loras)
        # Calls of each control route (pause, weights, flush, adapters ...), answered or not: rollq's own
        # `rollq:control_calls_total{route}` on /metrics (a LoRA run checks that no pause or full update came).
        self.control_calls: collections.Counter[str] = collections.Counter()
        self.cache_flushes = 0  # prefix-cache flushes done (tests read it: rollq's choice of when to flush)
        self.last_load_seconds = 0.0
        # Weight loads done (failed ones too) and whether one runs now: what reads the served weights outside the
        # update lock (a delta's prepare, a checksum) checks that no load ran meanwhile (weights_snapshot).
        self.weight_loads = 0
        self.loading = False
        self.generation_health = GenerationHealth(config.unhealthy_after_errors, config.unhealthy_for_s)

    # --- gate, aborts, waiting ---

    @property
    def admitting(self) -> bool:
        return not self.paused and not self._updating and self.phase != "closing"

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    def _gate_changed(self) -> None:
        self._pulse()
        if self.admitting or self.phase == "closing":
            for req in self.states.values():
                if req.wake is not None:
                    req.wake.set()

    def _abort(self, req: _Req, message: str) -> None:
        state = req.state
        if state.finish is not None or state.abort_message is not None:
            return
        state.abort_message = message
        self.counters["num_aborted_requests"] += 1
        if not req.started:
            state.finish = FinishReason(type="abort", message=WAITING_ABORT)
            if req.wake is not None:
                req.wake.set()

    def abort_all_dispatched(self, message: str) -> int:
        """abort_all as SGLang's scheduler sees it: every request past the pause gate (tokenizer_manager.py:2241-2265;
        the scheduler aborts its waiting queue and running batch, scheduler.py:5675-5720). Requests still held at the
        gate never reached the scheduler: they run after /continue_generation."""
        hits = [r for r in self.states.values() if r.started]
        for req in hits:
            self._abort(req, message)
        return len(hits)

    def abort_rid(self, rid: str, message: str = "Aborted by request.") -> bool:
        """/abort_request with a rid: the tokenizer manager forwards it only while that exact rid is live and was
        not aborted before (tokenizer_manager.py:2241-2256); held requests are not live yet."""
        req = self.states.get(rid)
        if req is None or not req.started or req.abort_sent:
            return False
        req.abort_sent = True
        self._abort(req, message)
        return True

    def _set_weight_version(self, version: str) -> None:
        if version == self.weight_version:
            return
        self.weight_version = version
        for req in self.states.values():
            if req.started and req.state.finish is None:
                req.segments.append((version, len(req.state.output_ids)))

    async def _execute(self, req: _Req) -> None:
        state = req.state
        while not self.admitting and state.finish is None:
            req.wake = asyncio.Event()
            await req.wake.wait()
        req.wake = None
        if state.finish is not None:  # aborted while waiting
            return
        req.started = True
        self.running += 1
        state.weight_version_start = self.weight_version
        req.segments = [(self.weight_version, len(state.output_ids))]
        try:
            if state.params.max_new_tokens == 0:
                state.finish = FinishReason(type="length", length=0)
            else:
                await self.backend.run(state)
                if state.finish is None:  # a backend bug must not leave the client without an answer
                    state.finish = FinishReason(type="abort", message="backend returned without finishing")
        except Exception as exc:
            self.generation_health.failed(f"{type(exc).__name__}: {exc}")
            raise
        else:
            self.generation_health.finished(state.finish)
        finally:
            self.running -= 1
            self.counters["generation_tokens"] += len(state.output_ids)
            self.counters["cached_tokens"] += state.cached_tokens
            if self.running == 0:
                self._pulse()

    # --- answers ---

    def _text(self, ids: list[int]) -> str:
        return self.backend.decode(ids)

    def _finish_dict(self, finish: FinishReason | None) -> dict[str, Any] | None:
        return None if finish is None else msgspec.to_builtins(finish)

    def output(self, req: _Req, call: GenerateCall, return_logprob: bool, *, final: bool) -> dict[str, Any]:
        state = req.state
        finish = state.finish if final else None
        meta: dict[str, Any] = {"id": state.rid, "finish_reason": self._finish_dict(finish)}
        old = self.config.compat == "0.5.5"
        ids = list(state.output_ids)
        if final and finish is not None and finish.type == "abort" and state.first_token_at is None:
            # Aborted in the waiting queue (or held at the gate at shutdown): no prompt_tokens; 0.5.23 sends text,
            # weight_version and completion_tokens (tokenizer_manager.py:3596-3636), 0.5.5 only id and finish_reason.
            # The finish reason is "Abort in waiting queue" unless the scheduler gave one: an engine error's, with
            # its message, status_code and err_type, is kept (0.5.23 tokenizer_manager.py:3596-3602, 0.5.5
            # :1950-1956), so a client sees an engine that failed, not a pause.
            if finish.status_code is None:
                meta["finish_reason"] = {"type": "abort", "message": WAITING_ABORT}
            if old:
                return {"meta_info": meta}
            meta.update(weight_version=self.weight_version, e2e_latency=time.monotonic() - state.created)
            meta["completion_tokens"] = len(ids)
            out: dict[str, Any] = {"output_ids": ids, "meta_info": meta}
            return {"text": "", **out} if not self.config.skip_tokenizer_init else out
        meta.update(
            prompt_tokens=len(state.input_ids),
            completion_tokens=len(ids),
            cached_tokens=state.cached_tokens,
            weight_version=self.weight_version,
        )
        meta["total_retractions" if old else "num_retractions"] = req.retractions
        if return_logprob:
            with_text = call.return_text_in_logprobs and not self.config.skip_tokenizer_init
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [lp, t, self._text([t]) if with_text else None]
                for lp, t in zip(state.output_logprobs, ids, strict=True)
            ]
            if req.top_logprobs_num > 0:  # accepted; top alternatives are not computed
                meta["input_top_logprobs"] = []
                meta["output_top_logprobs"] = [[] for _ in ids]
        if len(req.segments) > 1 and not old:
            meta["weight_versions"] = self._version_ranges(req, len(ids))
        meta["e2e_latency"] = time.monotonic() - state.created
        out = {"output_ids": ids, "meta_info": meta}
        if not self.config.skip_tokenizer_init:
            out = {"text": self._trimmed_text(state, ids, finish), **out}
        return out

    @staticmethod
    def _version_ranges(req: _Req, total: int) -> list[dict[str, Any]]:
        bounds = [*(start for _, start in req.segments[1:]), total]
        ranges: list[dict[str, Any]] = [
            {"version": v, "start": s, "end": e} for (v, s), e in zip(req.segments, bounds, strict=True)
        ]
        return [r for r in ranges if r["end"] > r["start"]] or ranges[-1:]

    def _trimmed_text(self, state: GenState, ids: list[int], finish: FinishReason | None) -> str:
        matched = None  # the stop token or string to trim, when there is one to trim
        if finish is not None and finish.type == "stop" and not state.params.no_stop_trim:
            matched = finish.matched
        if isinstance(matched, int) and ids and ids[-1] == matched:
            return self._text(ids[:-1])
        text = self._text(ids)
        if isinstance(matched, str):
            cut = text.rfind(matched)
            if cut >= 0:
                text = text[:cut]
        return text

    # --- /generate ---

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await _read_json(request)
        if isinstance(body, web.Response):
            return body
        if self.phase == "closing":
            return _engine_error("The server is shutting down.", 503)
        try:
            call = parse_generate(
                body,
                encode=self.backend.encode,
                vocab_size=self.backend.vocab_size,
                context_length=self.backend.context_length,
                tokenizer=not self.config.skip_tokenizer_init,
            )
            # Rids must be unique among requests in flight and within the call itself.
            seen: set[str] = set()
            for prompt in call.prompts:
                for rid in prompt.rids:
                    if rid in self.states or rid in seen:
                        raise EngineValueError(f"Duplicate request ID detected: {rid}")  # tokenizer_manager.py:3836
                    seen.add(rid)
            names = [prompt.lora_path for prompt in call.prompts for _ in prompt.rids]
            if any(names) and not self.config.enable_lora:
                # SGLang 0.5.5's /generate ignores lora_path then (tokenizer_manager.py:433) and serves the base
                # model: an adapter silently not applied. rollq refuses, with the words of its OpenAI routes.
                raise EngineValueError(NOT_ENABLED)
            images = await self._images(call)
            # A vision model sees every prompt here, with or without pictures: image tokens no picture fills are the
            # request's 400, not a failed forward of the whole batch.
            prepared = [
                await asyncio.to_thread(self.backend.prepare_images, list(p.input_ids), images[i] if images else [])
                if images or self.backend.supports_images
                else None
                for i, p in enumerate(call.prompts)
            ]
            adapters = self.adapters.acquire(names)  # AdapterError (unknown name): a ValueError, as in SGLang
        except BadRequest as exc:  # the request's shape: FastAPI / the contract check answer before any stream
            return _bad_request(str(exc))
        except (EngineValueError, NotImplementedError, AdapterError, MediaRefused, ImageRequestError) as exc:
            if body.get("stream") is True:
                return await self._stream_error(request, str(exc))
            return _engine_error(str(exc))

        items: list[tuple[_Req, bool]] = []
        for index, prompt in enumerate(call.prompts):
            for rid in prompt.rids:
                ready = prepared[index]
                state = GenState(
                    rid,
                    list(ready[0] if ready else prompt.input_ids),
                    prompt.params,
                    prompt.return_logprob,
                    prompt.priority,
                    adapters[len(items)],
                )
                if ready is not None:
                    state.images, state.vision = (images[index] if images else []), ready[1]
                items.append((_Req(state, prompt.top_logprobs_num), prompt.return_logprob))
                self.counters["prompt_tokens"] += len(state.input_ids)
        self.counters["num_requests"] += len(items)
        for req, _ in items:
            self.states[req.state.rid] = req
        try:
            if call.stream:
                return await self._stream(request, call, items)
            try:
                if len(items) == 1:
                    await self._execute(items[0][0])
                else:
                    await asyncio.gather(*(self._execute(req) for req, _ in items))
            except Exception as exc:
                log.exception("generation failed")
                for req, _ in items:
                    self._abort(req, "generation failed")
                return _engine_error(f"Internal server error: {type(exc).__name__}: {exc}", 500)
            failure = next((f for req, _ in items if (f := self._abort_failure(req.state.finish)) is not None), None)
            if failure is not None:
                return failure
            outs = [self.output(req, call, lp, final=True) for req, lp in items]
        finally:
            for req, _ in items:
                self.states.pop(req.state.rid, None)
                self.adapters.release(req.state.adapter)
        return _json(outs if call.batched else outs[0])

    def _abort_failure(self, finish: FinishReason | None) -> web.Response | None:
        """The HTTP error a non-streamed request answers when one of its samples ended in an abort carrying an error
        status, as SGLang's tokenizer manager raises it (0.5.23 tokenizer_manager.py:1891-1921: 400 as a ValueError,
        any other 4xx or 5xx as an HTTPException; 0.5.5 tokenizer_manager.py:1017-1048: 400, 500 and 503 only). A
        streamed request gets the abort chunk itself, with its status_code and err_type (same lines)."""
        if finish is None or finish.type != "abort" or finish.status_code is None:
            return None
        code = finish.status_code
        if not (code in (400, 500, 503) if self.config.compat == "0.5.5" else 400 <= code < 600):
            return None
        message = finish.message or "aborted"
        if code == 400:  # a ValueError: http_server.py:988-990 and _create_error_response, 2246-2250
            return _engine_error(message)
        # an HTTPException on /generate: SGLang's handler answers an ErrorResponse (http_server.py:578-631)
        return _json({"object": "error", "message": message, "type": str(code), "param": None, "code": code}, code)

    async def _stream_error(self, request: web.Request, message: str) -> web.StreamResponse:
        """A ValueError of a streamed request: HTTP 200, one error event, then [DONE] (http_server.py:951-975)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        error = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
        await resp.write(b"data: " + msgspec.json.encode({"error": error}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _stream(
        self, request: web.Request, call: GenerateCall, items: list[tuple[_Req, bool]]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        tasks = [asyncio.create_task(self._execute(req)) for req, _ in items]
        sent = [-1] * len(items)  # output length at the last chunk sent
        done_sent = [False] * len(items)
        try:
            while True:
                for i, ((req, lp), task) in enumerate(zip(items, tasks, strict=True)):
                    finished = task.done()
                    n = len(req.state.output_ids)
                    if done_sent[i] or (n == sent[i] and not finished) or (n == 0 and not finished):
                        continue
                    chunk = self.output(req, call, lp, final=finished)
                    if self.config.compat == "0.5.5" and "output_ids" in chunk:
                        chunk["output_ids"] = chunk["output_ids"][max(sent[i], 0) :]  # 0.5.5 streams deltas
                    if call.batched:
                        chunk["index"] = i
                    await resp.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
                    sent[i], done_sent[i] = n, finished
                if all(done_sent):
                    break
                pending = [t for t in tasks if not t.done()]
                if pending:
                    await asyncio.wait(pending, timeout=self.config.stream_poll_s, return_when=asyncio.FIRST_COMPLETED)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            for req, _ in items:  # the client went away: free the engine
                self._abort(req, "client disconnected")
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        for task in tasks:
            task.result()  # surface backend errors in the log
        return resp

    # --- control ---

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _read_json(request, optional=True)
        if isinstance(body, web.Response):
            return body
        requested = "abort" if self.config.compat == "0.5.5" else body.get("mode") or "abort"
        mode = next((m for m in _PAUSE_MODES if m == requested), None)
        if mode is None:
            return _bad_request(f"mode must be one of {', '.join(_PAUSE_MODES)}, got {requested!r}")
        self.paused = True
        self.pause_mode = mode
        self._gate_changed()
        if mode == "abort":
            # 0.5.23 aborts and waits until no dispatched request holds the model lock (tokenizer_manager.py:
            # 2267-2280); 0.5.5 ignores the mode, aborts and returns at once.
            self.abort_all_dispatched("Aborted by pause_generation.")
            if self.config.compat != "0.5.5":
                await self._wait_for(lambda: self.running == 0)
        elif mode == "retract":
            for req in self.states.values():
                if req.started and req.state.finish is None:
                    req.retractions += 1
                    self.counters["num_retracted_requests"] += 1
        await self.backend.pause(mode)
        self._frozen = True
        self._pulse()
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        body = await _read_json(request, optional=True)
        if isinstance(body, web.Response):
            return body
        if self.paused:
            self._frozen = False
            await self.backend.resume()
        self.paused = False
        self.pause_mode = None
        self._gate_changed()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _read_json(request, optional=True)
        if isinstance(body, web.Response):
            return body
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all"))
        if not isinstance(rid, str):
            return _bad_request("rid must be a string")
        if abort_all:
            self.abort_all_dispatched("Aborted by request.")
        elif rid:  # an empty rid without abort_all is ignored (tokenizer_manager.py:2242-2245)
            self.abort_rid(rid)
        return web.Response(status=200)

    def running_batch_holds_kv(self) -> bool:
        """Whether a flush would free KV a request still needs: SGLang flushes only when the running batch is empty,
        ignoring the waiting queue while paused (scheduler.py:5518-5547, is_fully_idle 5337-5359). Requests held at
        the pause gate never reached the scheduler; retract and abort pauses empty the running batch."""
        busy = any(r.started and r.state.finish is None for r in self.states.values())
        if not busy:
            return False
        return not (self.paused and self.pause_mode in ("retract", "abort"))

    def flush_prefix_cache(self) -> bool:
        if self.running_batch_holds_kv():
            return False
        self.backend.flush_cache()
        self.cache_flushes += 1
        return True

    async def apply_weight_update(
        self,
        load: Callable[[], Awaitable[Any]],
        *,
        version: str | None,
        flush_cache: bool,
        abort_all: bool,
    ) -> tuple[bool, str, int, float]:
        """SGLang's update path, for every source (disk, distributed): abort_all first when asked; on a server that
        is not paused, wait for in-flight requests behind the model-update lock, holding new ones
        (tokenizer_manager.py:2288-2318); load; then flush the prefix cache when asked. A flush refused because the
        running batch holds KV (an in_place pause) fails the call although the weights ARE loaded, and the reported
        version stays the old one (weight_updater.py:119-133, tokenizer_manager.py:2314). Returns
        (success, message, num_paused_requests, load seconds)."""
        async with self._update_lock:
            if abort_all:
                self.abort_all_dispatched("Aborted for a weight update.")
            self._updating += 1
            self._gate_changed()
            try:
                await self._wait_for(lambda: self.running == 0 or self._frozen)
                paused_before = self._frozen
                num_paused = self.running if paused_before else 0
                if not paused_before:
                    await self.backend.pause("in_place")  # no decode step may run during the load
                started = time.monotonic()
                self.loading = True
                try:
                    await load()
                except Exception as exc:
                    return False, f"Failed to update weights: {exc}", num_paused, 0.0
                finally:
                    # counted failed or not: a failed load may have changed some tensors (a receive cut short)
                    self.loading = False
                    self.weight_loads += 1
                    if not paused_before and not self.paused:
                        await self.backend.resume()
                load_s = time.monotonic() - started
                self.last_load_seconds = load_s
                if flush_cache and not self.flush_prefix_cache():
                    return (
                        False,
                        "Weights were updated, but the cache was not flushed because requests are still running or "
                        "queued. Retract or finish them, then call /flush_cache.",
                        num_paused,
                        load_s,
                    )
                if version is not None:
                    self._set_weight_version(version)
                return True, "Succeeded to update model weights.", num_paused, load_s
            finally:
                self._updating -= 1
                self._gate_changed()

    async def weights_snapshot(self) -> tuple[int, str]:
        """(loads done, weight version) at a moment no load runs: the update lock is held only to read them. A reader
        of the served weights (in a thread, while generation goes on) that finds `weights_unchanged(loads)` after
        reading them read one whole version."""
        async with self._update_lock:
            return self.weight_loads, self.weight_version

    def weights_unchanged(self, loads: int) -> bool:
        return not self.loading and self.weight_loads == loads

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _read_json(request)
        if isinstance(body, web.Response):
            return body
        path = body.get("model_path")
        version = body.get("weight_version")
        if not isinstance(path, str) or not path:
            return _bad_request("model_path is required")
        if version is not None and not isinstance(version, str):
            return _bad_request("weight_version must be a string")
        flush = body.get("flush_cache", True)  # io_struct.py:1993: defaults to true
        if not isinstance(flush, bool):
            return _bad_request("flush_cache must be a boolean")
        try:  # before the update lock and the pause: a refused path changes nothing and waits for nothing
            resolved = str(resolve_under(self.config.weights_root, path))
        except WeightsPathRefused as exc:
            return _json({"success": False, "message": str(exc), "num_paused_requests": 0}, 400)
        load: Callable[[], Awaitable[Any]] = lambda: self.backend.load_weights(resolved)  # noqa: E731
        if is_delta_dir(resolved):  # a weight delta: what its prepare staged is swapped in, or it is applied here
            deltas = request.app[DELTA_ROUTES_KEY]
            try:
                load, version = await deltas.swap_load(resolved, version)
            except ValueError as exc:
                return _json({"success": False, "message": str(exc), "num_paused_requests": 0}, 400)
        success, message, num_paused, load_s = await self.apply_weight_update(
            load,
            version=version,
            flush_cache=flush or self.config.compat == "0.5.5",  # 0.5.5 always flushes (its pause always aborts)
            abort_all=bool(body.get("abort_all_requests")),
        )
        if success and version is not None:
            message += f" Weight version updated to {version}."
        if success:  # one line per update: which version each engine of a fleet serves, in its own log
            log.info("weights loaded from %s in %.2f s (weight version %s)", resolved, load_s, version or "unchanged")
        # load_seconds is rollq's addition (clients ignore unknown keys): lets fleet timing exclude the load itself.
        reply = {"success": success, "message": message, "num_paused_requests": num_paused}
        return _json({**reply, "load_seconds": round(load_s, 6)}, 200 if success else 400)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _read_json(request)
        if isinstance(body, web.Response):
            return body
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            return _bad_request("new_version is required")
        if body.get("abort_all_requests", True):
            self.abort_all_dispatched("Aborted for a weight version update.")
        self._set_weight_version(version)
        return _json({"success": True, "message": f"Weight version updated to {version}", "new_version": version})

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return _json({"weight_version": self.weight_version})

    async def flush_cache(self, request: web.Request) -> web.Response:
        note = (
            "Please check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )
        # Refused while the running batch (or, unpaused, the waiting queue) holds requests (http_server.py:1025-1040,
        # scheduler.py:5518-5547).
        if not self.flush_prefix_cache():
            return web.Response(text="Cache not flushed.\n" + note, status=400)
        return web.Response(text="Cache flushed.\n" + note)

    # --- health and info ---

    async def health(self, request: web.Request) -> web.Response:
        """/health and /health_generate: 200 once a one-token generation answers. The probe waits at the pause gate and
        behind a weight update like any request (tokenizer_manager.py:938-941), and the handler gives up after
        SGLANG_HEALTH_CHECK_TIMEOUT (20 s; http_server.py:218, 722-799): a paused or updating server answers 503
        after that long. `health_timeout_s` sets it (tests run it short).

        An engine whose generations fail with engine errors answers 503 (engine/server/health.py): at once while
        its recent generations do, and when the probe's own generation ends in an engine error. Any other answer
        counts, an abort by a pause included (SGLang looks only at last_receive_tstamp)."""
        if self.phase != "ready" or self.generation_health.failing:
            return web.Response(status=503)
        deadline = time.monotonic() + self.config.health_timeout_s
        try:
            gate = self._wait_for(lambda: self.admitting or self.phase != "ready")
            await asyncio.wait_for(gate, self.config.health_timeout_s)
        except TimeoutError:
            return web.Response(status=503)
        if self.phase != "ready":
            return web.Response(status=503)
        state = GenState(f"HEALTH_CHECK_{uuid.uuid4().hex}", [1], SamplingParams(max_new_tokens=1, temperature=0.0))
        task = asyncio.create_task(self.backend.run(state))
        await asyncio.wait([task], timeout=max(0.0, deadline - time.monotonic()))
        if not task.done():
            state.abort_message = "health check timed out"
            await asyncio.wait([task], timeout=1.0)
            return web.Response(status=503)
        exc = task.exception()
        error = f"{type(exc).__name__}: {exc}" if exc is not None else None
        if error is None and is_engine_error(state.finish):
            assert state.finish is not None
            error = state.finish.message or "engine error"
        self.generation_health.probed(error)
        return web.Response(status=503 if error is not None else 200)

    async def ready(self, request: web.Request) -> web.Response:
        # is_ready = not paused and healthy (tokenizer_manager.py:728-734, http_server.py:714-719); healthy includes
        # generations not failing with engine errors (what /health says, engine/server/health.py)
        healthy = self.phase == "ready" and self.generation_health.ready
        return web.Response(status=200 if healthy and not self.paused else 503)

    def model_name(self) -> str:
        return self.config.served_model_name or self.backend.model_path

    async def model_info(self, request: web.Request) -> web.Response:
        return _json(
            {
                "model_path": self.backend.model_path,
                "tokenizer_path": self.config.tokenizer_path or self.backend.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": type(self.backend).__name__,
                "architectures": None,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        stats = self.gauges()
        info = {
            "model_path": self.backend.model_path,
            "tokenizer_path": self.config.tokenizer_path or self.backend.model_path,
            "served_model_name": self.model_name(),
            "host": self.config.host,
            "port": self.config.port,
            "skip_tokenizer_init": self.config.skip_tokenizer_init,
            "context_length": self.backend.context_length,
            "weight_version": self.weight_version,
            "enable_metrics": True,
            "tp_size": 1,
            "dp_size": 1,
            "backend": type(self.backend).__name__,
            "internal_states": [
                {
                    "last_gen_throughput": stats["gen_throughput"],
                    "num_running_reqs": stats["num_running_reqs"],
                    "num_queue_reqs": stats["num_queue_reqs"],
                    "token_usage": stats["token_usage"],
                    "paused": self.paused,
                    "pause_mode": self.pause_mode,
                }
            ],
            "version": self.config.compat,
            "dtype": self.backend.served_dtype,  # SGLang's server_args.dtype: the trainer's sync_dtype "auto" reads it
        }
        return _json(info)

    async def models(self, request: web.Request) -> web.Response:
        """The served model's card, then one per loaded adapter (http_server.py:1169-1198 in 0.5.5)."""
        name = self.model_name()
        card = {"object": "model", "created": int(self.started_at), "owned_by": "sglang"}
        cards = [{"id": name, **card, "root": name, "max_model_len": self.backend.context_length}]
        cards += [
            {"id": ref.name, **card, "root": ref.path, "parent": name, "max_model_len": None}
            for ref in self.adapters.refs()
        ]
        return _json({"object": "list", "data": cards})

    def gauges(self) -> dict[str, float]:
        stats = self.backend.stats()
        queued = float(stats.get("num_queue_reqs", 0.0))
        waiting = len(self.states) - self.running
        return {
            "num_running_reqs": max(0.0, self.running - queued),
            "num_queue_reqs": waiting + queued,
            "num_paused_reqs": float(self.running) if self.paused else 0.0,
            "token_usage": float(stats.get("token_usage", 0.0)),
            "gen_throughput": float(stats.get("gen_throughput", 0.0)),
            "cache_hit_rate": float(stats.get("cache_hit_rate", 0.0)),
        }

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text under SGLang 0.5.23's metric names (observability/metrics_collector.py:365-405, 574,
        1856-1960): gauges sglang:num_running_reqs ... and counters sglang:<name>_total."""
        labels = f'{{model_name="{self.model_name()}",engine_type="unified"}}'
        lines: list[str] = []
        for name, value in self.gauges().items():
            lines += [
                f"# HELP sglang:{name} {name.replace('_', ' ')}.",
                f"# TYPE sglang:{name} gauge",
                f"sglang:{name}{labels} {float(value)}",
            ]
        for name, value in self.counters.items():
            lines += [
                f"# HELP sglang:{name}_total {name.replace('_', ' ')}.",
                f"# TYPE sglang:{name}_total counter",
                f"sglang:{name}_total{labels} {float(value)}",
            ]
        lines += ["# HELP rollq:control_calls_total control route calls.", "# TYPE rollq:control_calls_total counter"]
        lines += [f'rollq:control_calls_total{{route="{r}"}} {float(n)}' for r, n in sorted(self.control_calls.items())]
        return web.Response(
            text="\n".join(lines) + "\n",
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff"},
        )

    async def _images(self, call: GenerateCall) -> list[list[ImageFile]]:
        """Each prompt's image_data, loaded under the media policy ([] when the call has none)."""
        if not any(p.image_data for p in call.prompts):
            return []
        if not self.backend.supports_images:
            raise EngineValueError(f"this engine's model ({self.backend.model_path}) takes no image input")
        if self._media_http is None and self.config.media.url_hosts:
            self._media_http = aiohttp.ClientSession()
        # One tally for the whole call: its images counted before any is read, then their bytes and pixels.
        media = self.config.media
        tally = ImageTally(media.limits(), "the request")
        try:
            tally.count(sum(len(p.image_data) for p in call.prompts))
        except ImageLimitError as exc:
            raise MediaRefused(f"image_data: {exc}") from None
        tally.images = 0  # counted again prompt by prompt below
        return [await load_images(p.image_data, media, self._media_http, tally) for p in call.prompts]

    # --- lifecycle ---

    async def on_startup(self, app: web.Application) -> None:
        await self.backend.start()
        if self.config.lora_paths and not self.backend.supports_lora:
            raise RuntimeError(f"{type(self.backend).__name__} serves no LoRA adapters (lora_paths given)")
        for item in self.config.lora_paths:  # server_args.py:3804-3813: NAME=PATH, or PATH named by itself
            name, sep, path = item.partition("=")
            reply = await app[LORA_ROUTES_KEY].load_adapter(name if sep else item, path if sep else item)
            if reply.status != 200:
                raise RuntimeError(f"Failed to load LoRA adapter {item}: {reply.text}")
        self.phase = "ready"

    async def on_shutdown(self, app: web.Application) -> None:
        self.phase = "closing"
        for req in list(self.states.values()):  # held requests too: nothing will serve them
            self._abort(req, "The server is shutting down.")
        if self.paused:
            self._frozen = False
            await self.backend.resume()  # let frozen states see their abort
        self._gate_changed()

    async def on_cleanup(self, app: web.Application) -> None:
        if self._media_http is not None:
            await self._media_http.close()
        await self.backend.close()


async def _read_json(request: web.Request, optional: bool = False) -> dict[str, Any] | web.Response:
    raw = await read_body(request)  # 408 for a body that trickles in (body_timeout_s)
    if not raw.strip():
        return {} if optional or request.method != "POST" else _bad_request("the request needs a JSON body")
    try:
        body = msgspec.json.decode(raw)
    except BAD_JSON as exc:  # invalid UTF-8 and too deep nesting are the client's fault too, never a 500
        return _bad_request(f"Invalid JSON body: {exc}")
    if not isinstance(body, dict):
        if optional and body is None:
            return {}
        return _bad_request("the request body must be a JSON object")
    return body


def _bearer_ok(header: str, key: str) -> bool:
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode())


def _auth_middleware(api_key: str | None, admin_api_key: str | None):
    """SGLang 0.5.23's auth decision (utils/auth.py:76-150): health/ready/metrics are open; a control route needs the
    admin key when one is set (the api key is then not accepted), else the api key when set; any other route needs
    the api key when set."""

    @web.middleware
    async def auth(request: web.Request, handler):
        path = request.path
        if request.method != "OPTIONS" and not path.startswith(_OPEN_PREFIXES):
            key = (admin_api_key or api_key) if path in ADMIN_ROUTES else api_key
            if key and not _bearer_ok(request.headers.get("Authorization", ""), key):
                return _json({"error": "Unauthorized"}, 401)
        return await handler(request)

    return auth


CONTROL_CLOSED = (
    "this engine was started without keys: its control routes are closed (start it with admin_api_key, "
    "--admin-api-key or ROLLQ_ENGINE_ADMIN_API_KEY, and give the trainer that key as engine_admin_api_key; or "
    "insecure_no_auth: true to open them to every process that reaches it)"
)


def _closed_control():
    """An engine without keys, not opened with insecure_no_auth: every control route answers 403 naming the settings
    (generation stays open, as SGLang's without keys)."""

    @web.middleware
    async def closed(request: web.Request, handler):
        if request.path in ADMIN_ROUTES and request.method != "OPTIONS":
            return _json({"error": CONTROL_CLOSED}, 403)
        return await handler(request)

    return closed


def _control_counter(server: EngineServer):
    @web.middleware
    async def count(request: web.Request, handler):
        if request.path in ADMIN_ROUTES:
            server.control_calls[request.path] += 1
        return await handler(request)

    return count


SERVER_KEY = web.AppKey("engine_server", EngineServer)


def build_app(backend: Backend, config: EngineServerConfig) -> web.Application:
    server = EngineServer(backend, config)
    keyed = config.api_key or config.admin_api_key
    middlewares = [_control_counter(server)]
    if keyed:
        middlewares.append(_auth_middleware(config.api_key, config.admin_api_key))
    elif config.control_closed:
        middlewares.append(_closed_control())
    app = web.Application(
        middlewares=middlewares,
        client_max_size=config.max_body_bytes,
    )
    app[SERVER_KEY] = server
    s = server
    r = app.router
    r.add_post("/generate", s.generate)
    r.add_put("/generate", s.generate)
    r.add_post("/pause_generation", s.pause_generation)
    r.add_post("/continue_generation", s.continue_generation)
    r.add_post("/abort_request", s.abort_request)
    r.add_post("/update_weights_from_disk", s.update_weights_from_disk)
    r.add_post("/update_weight_version", s.update_weight_version)
    old = config.compat == "0.5.5"
    if old:  # removed in 0.5.23 (read /model_info)
        r.add_get("/get_weight_version", s.get_weight_version)
    for path in ("/flush_cache",):
        r.add_get(path, s.flush_cache)
        r.add_post(path, s.flush_cache)
    for path in ("/health", "/health_generate"):
        r.add_get(path, s.health)
    if not old:  # 0.5.5 has no /ready (its http_server.py serves /health, /health_generate only)
        r.add_get("/ready", s.ready)
    for path in ("/get_model_info",) if old else ("/model_info", "/get_model_info"):
        r.add_get(path, s.model_info)
    for path in ("/get_server_info",) if old else ("/server_info", "/get_server_info"):
        r.add_get(path, s.server_info)
    r.add_get("/v1/models", s.models)
    r.add_get("/metrics", s.metrics)
    add_distributed_routes(app, server)
    add_lora_routes(app, server)
    add_delta_routes(app, server)
    app.on_startup.append(s.on_startup)
    app.on_shutdown.append(s.on_shutdown)
    app.on_cleanup.append(s.on_cleanup)
    return app


class ServerHandle:
    """A running server: `.url`, `.server` (its state, for in-process tests and tools), `await close()`."""

    def __init__(self, runner: web.AppRunner, server: EngineServer, host: str, port: int) -> None:
        self.runner = runner
        self.server = server
        self.url = f"http://{host}:{port}"

    async def close(self) -> None:
        await self.runner.cleanup()


async def serve(backend: Backend, config: EngineServerConfig) -> ServerHandle:
    app = build_app(backend, config)
    runner, port = await start_site(
        app,
        config.host,
        config.port,
        header_timeout_s=config.header_timeout_s,
        body_timeout_s=config.body_timeout_s,
        backlog=4096,
        reuse_address=True,
        access_log=None,
        handle_signals=False,
        shutdown_timeout=config.shutdown_timeout_s,
    )
    host = config.host if config.host not in ("0.0.0.0", "::") else "127.0.0.1"
    return ServerHandle(runner, app[SERVER_KEY], host, port)
