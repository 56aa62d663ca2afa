"""The recording proxy: an OpenAI- and Anthropic-compatible HTTP server (one per worker process) in front of the
engine pool, that records every completion token-exactly under the calling episode's session key.

Token in, token out: a request that continues a recorded conversation is sent to the engine as the parent's exact
prompt + output ids followed by only the new turns' tokens; generated text is never re-tokenized. So a chain of
turns is one growing token sequence (the `concat` export), and what the engine sampled is what gets trained.

Images (user messages' data URIs) are rendered by the chat template as image placeholders and expanded by the
model's processor into the image's tokens; the request carries them to the engine as `image_data`, and the record
keeps the prompt's images (all of the conversation's so far, in order), so its sequences carry them too.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Literal

import msgspec
from aiohttp import web

from rollq.engine.client import EngineError
from rollq.engine.images import DEFAULT_MAX_PIXELS
from rollq.engine.types import InferenceEngine, ModelRequest, ModelResponse, SamplingParams
from rollq.http_server import BAD_JSON, read_body, start_site
from rollq.tracing import INVALID_SPAN, NO_SPAN, Span, SpanKind, Tracing, generation
from rollq.workers.chat_template import stop_token_ids
from rollq.workers.proxy import anthropic, responses
from rollq.workers.proxy.chat import (
    BadRequest,
    ChoiceOut,
    GenerationParams,
    chat_completion,
    chat_stream,
    generation_params,
    message_images,
    normalize_messages,
    normalize_tools,
    parse_reply,
    text_completion,
    text_stream,
    tool_choice_allows_calls,
    trim_stop,
)
from rollq.workers.proxy.prompt_encoder import PromptEncoder
from rollq.workers.proxy.sessions import CompletionRecord, Session, SessionClosed, SessionStore
from rollq.workers.proxy.streaming import TextStream, stream_deltas
from rollq.workers.proxy.vision import ImageProcessor, PromptVision, continued

log = logging.getLogger("rollq.proxy")


class ProxyConfig(msgspec.Struct, kw_only=True, frozen=True):
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    model_name: str = "rollq"  # what /v1/models lists; requests may name any model
    default_max_tokens: int = 512  # for chat requests without max_tokens (OpenAI's default is the context size)
    max_body_bytes: int = 64 << 20
    # How a request that continues a recorded conversation is tokenized. "exact": the parent's exact prompt + output
    # ids, then only the new turns' tokens (one growing sequence; what the model sampled is what it is trained on).
    # "template": the chat template renders the whole conversation again, as the model would see it when served
    # (templates that rewrite earlier turns, e.g. drop their reasoning): a new token sequence, still the parent's
    # child for rewards.
    continuation: Literal["exact", "template"] = "exact"
    # Read timeouts (rollq/http_server.py). The head timeout is also the idle keep-alive timeout: above the agents'
    # clients' keep-alive (aiohttp's 15 s, httpx's 5 s), so a reused connection is never closed under a request.
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    # An image in a request with more pixels than this (read from its header, before decoding) is a 400: the
    # worker's max_image_pixels, as for images in jobs' data.
    max_image_pixels: int = DEFAULT_MAX_PIXELS


class _Prompt(msgspec.Struct, kw_only=True):
    ids: list[int]
    parent: str | None
    messages: list[Any] | None = None
    tools: Any = None
    vision: PromptVision | None = None


class _Unauthorized(Exception):
    pass


def _json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


def _openai_error(
    message: str, status: int, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
):
    return _json_response({"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status)


def _anthropic_error(message: str, status: int, kind: str = "invalid_request_error"):
    return _json_response({"type": "error", "error": {"type": kind, "message": message}}, status=status)


def _refusal(exc: Exception) -> str | None:
    """The engine's reason when it refused the request itself (4xx: context too long, bad token ids, a request this
    engine cannot serve): the client's fault, answered 400. None for the engine's or rollq's own failures (down, 5xx,
    or 401/403: the worker's engine key is wrong), answered 502."""
    if isinstance(exc, EngineError) and 400 <= exc.status < 500 and exc.status not in (401, 403):
        return f"the engine refused the request: {exc.message}"
    return None


class RecordingProxy:
    def __init__(self, engine: InferenceEngine | None, tokenizer: Any, config: ProxyConfig | None = None) -> None:
        self.engine = engine  # anything with `async agenerate(ModelRequest) -> ModelResponse` (the EnginePool)
        self.tokenizer = tokenizer
        self.prompts = PromptEncoder(tokenizer)
        # Token ids a completions prompt may hold: what the tokenizer can decode (None: it does not say).
        self.vocab_size: int | None = len(tokenizer) if hasattr(tokenizer, "__len__") else None
        self.config = config or ProxyConfig()
        self.images = ImageProcessor(tokenizer, self.config.max_image_pixels)
        self.sessions = SessionStore()
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- lifecycle ---------------------------------------------------------------------------------------------------

    @property
    def root_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The base URL agents get: OpenAI-style (the OpenAI SDKs append /chat/completions), and the Anthropic SDKs,
        which append /v1/messages, are served under it too (AReaL's agents hand one base_url to either SDK)."""
        return f"{self.root_url}/v1"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/messages", self.messages)  # anthropic_base_url (the root) + /v1/messages
        app.router.add_post("/v1/v1/messages", self.messages)  # base_url (.../v1) + /v1/messages
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_get("/health", self.health)
        return app

    async def start(self) -> RecordingProxy:
        # handler_cancellation: a client that goes away (an SDK timing out before it retries) cancels its handler,
        # and with it the generation, which is then never recorded.
        self._runner, self.port = await start_site(
            self.app(),
            self.config.host,
            self.config.port,
            header_timeout_s=self.config.header_timeout_s,
            body_timeout_s=self.config.body_timeout_s,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,
        )
        log.info("recording proxy on %s", self.base_url)
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- plumbing ----------------------------------------------------------------------------------------------------

    def _session(self, request: web.Request) -> Session:
        key = request.headers.get("x-api-key") or ""
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            key = auth[7:].strip()
        if not key:
            raise _Unauthorized("missing API key: use the api_key (session key) your episode was given")
        session = self.sessions.get(key)
        if session is None:
            raise _Unauthorized("unknown or finished session key: each episode must use the api_key it was given")
        return session

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        raw = await read_body(request)  # 408 for a body that trickles in
        try:
            body = msgspec.json.decode(raw)
        except BAD_JSON as exc:
            raise BadRequest(f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    def _pieces(self, ids: list[int]) -> list[str]:
        return self.tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=True)

    async def _generate(
        self,
        session: Session,
        prompt: _Prompt,
        params: GenerationParams,
        *,
        parse_tools: bool,
        rid: str,
        want_pieces: bool,
        on_tokens: list[Any] | None = None,
    ) -> list[ChoiceOut]:
        sampling = SamplingParams(
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            stop=params.stop,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            stop_token_ids=list(stop_token_ids(self.tokenizer)),  # end of turn, whatever the server's flags
        )
        engine = self.engine
        if engine is None:  # a proxy started before any worker gave it an engine (see WorkerContext.proxy)
            raise RuntimeError("the recording proxy has no inference engine")
        request = ModelRequest(
            input_ids=prompt.ids,
            sampling=sampling,
            affinity=session.key,  # every turn and choice of an episode to one engine: its prefix cache holds them
            priority=session.priority,
            lora_path=session.lora,
            image_data=list(prompt.vision.images) if prompt.vision is not None else None,
        )
        traced = session.tracing if session.tracing is not None and session.tracing.enabled else None
        span: Span = INVALID_SPAN
        if traced is not None:  # the episode's child: the handler runs outside the episode's task
            span = traced.start("proxy.completion", parent=session.traceparent, kind=SpanKind.SERVER)
        try:
            with traced.within(span) if traced is not None else NO_SPAN:
                responses = await asyncio.gather(
                    *(
                        self._one_generation(traced, engine, request, on_tokens[i] if on_tokens else None)
                        for i in range(params.n)
                    )
                )
            choices = self._choices(session, prompt, params, responses, rid, parse_tools, want_pieces)
            if traced is not None and span.is_recording():
                span.set_attributes(
                    {
                        "rollq.model": params.model,
                        "rollq.rid": rid,
                        "rollq.choices": params.n,
                        "rollq.prompt_tokens": len(prompt.ids),
                        "rollq.completion_tokens": sum(len(r.output_tokens) for r in responses),
                        "rollq.images": len(prompt.vision.images) if prompt.vision is not None else 0,
                        "rollq.finish_reasons": [c.reply.finish_reason for c in choices],
                        "rollq.tool_calls": [
                            str(call.get("function", {}).get("name", ""))
                            for c in choices
                            for call in c.reply.tool_calls
                        ],
                    }
                )
                traced.set_text(span, "rollq.messages", msgspec.json.encode(prompt.messages).decode())
                traced.set_text(span, "rollq.completion", [c.raw_text for c in choices])
        except BaseException as exc:
            if traced is not None:  # its type; its message only with trace_text (it may quote the agent's request)
                traced.error(span, type(exc).__name__, str(exc) or repr(exc))
            raise
        finally:
            span.end()
        return choices

    @staticmethod
    async def _one_generation(
        traced: Tracing | None, engine: InferenceEngine, request: ModelRequest, on_tokens: Any
    ) -> ModelResponse:
        if traced is None:
            return await engine.agenerate(request, on_tokens=on_tokens)
        if getattr(engine, "traces_calls", False):  # the worker's episode engine makes the call's span itself
            with traced.installed():
                return await engine.agenerate(request, on_tokens=on_tokens)
        return await generation(traced, request, engine.agenerate(request, on_tokens=on_tokens))

    def _choices(
        self,
        session: Session,
        prompt: _Prompt,
        params: GenerationParams,
        responses: list[ModelResponse],
        rid: str,
        parse_tools: bool,
        want_pieces: bool,
    ) -> list[ChoiceOut]:
        """The engine's responses as the client's choices, each recorded in the session."""
        order = session.next_order()
        choices = []
        for index, resp in enumerate(responses):
            raw = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
            reply = parse_reply(trim_stop(raw, params.stop), resp.stop_reason, parse_tools=parse_tools)
            record = CompletionRecord(
                id=rid,
                choice=index,
                order=order,
                parent=prompt.parent,
                prompt_ids=prompt.ids,
                output_ids=list(resp.output_tokens),
                output_logprobs=list(resp.output_logprobs),
                output_versions=list(resp.output_versions),
                finish_reason=reply.finish_reason,
                messages=prompt.messages,
                tools=prompt.tools,
                reply=reply.normalized() if prompt.messages is not None else None,
                vision=prompt.vision,
            )
            try:
                session.add(record)
            except SessionClosed:
                log.warning("completion %s finished after its episode ended; not recorded", record.key)
            choices.append(
                ChoiceOut(
                    reply=reply,
                    pieces=self._pieces(resp.output_tokens) if want_pieces else [],
                    logprobs=list(resp.output_logprobs),
                    completion_tokens=len(resp.output_tokens),
                    raw_text=raw,
                    record=record,
                )
            )
        return choices

    async def _chat_prompt(self, session: Session, messages: list[dict[str, Any]], tools: Any) -> _Prompt:
        match = session.chat_parent(messages, tools)
        parent_key = None
        if match is not None:
            parent, start = match
            parent_key = parent.key
            # The parent's own message objects (equal: just matched), so a session's records share one copy of each
            # earlier turn, its images' data URIs included, rather than one per request that repeats them.
            messages = [*(parent.messages or ()), parent.reply, *messages[start:]]
            if self.config.continuation == "exact":
                return await self._continued_prompt(parent, messages, start, tools)
        images = message_images(messages)  # a root, or "template": the whole conversation rendered again
        if images:
            await self.images.ready()  # first: a text model's template can't render image parts
            ids, vision = await self.images.expand(self.prompts.chat_text(messages, tools), images)
            return _Prompt(ids=ids, parent=parent_key, messages=messages, tools=tools, vision=vision)
        return _Prompt(ids=self.prompts.chat(messages, tools), parent=parent_key, messages=messages, tools=tools)

    async def _continued_prompt(
        self, parent: CompletionRecord, messages: list[dict[str, Any]], start: int, tools: Any
    ) -> _Prompt:
        """The parent's exact prompt + output ids, then the new turns' tokens (their images expanded on their own:
        the parent's are in its record)."""
        new = messages[start:]
        images = message_images(new)
        if images:
            await self.images.ready()
            suffix, new_vision = await self.images.expand(
                self.prompts.continuation_text(parent.output_ids, new), images
            )
        else:
            suffix, new_vision = self.prompts.continuation(parent.output_ids, new), None
        return _Prompt(
            ids=parent.full_ids + suffix,
            parent=parent.key,
            messages=messages,
            tools=tools,
            vision=continued(parent.vision, len(parent.full_ids), new_vision, len(suffix)),
        )

    def _max_tokens(self, session: Session) -> int:
        return int(session.defaults.get("max_tokens") or self.config.default_max_tokens)

    async def _deliver(self, request: web.Request, body: Any, choices: list[ChoiceOut]) -> web.Response:
        """Send a finished response. Its completions count (`delivered`) only once it is handed to the client's
        connection: marked just before the bytes go out (the client can't act on them earlier), unmarked if the
        connection is gone."""
        resp = _json_response(body)
        try:
            await resp.prepare(request)
            _mark_delivered(choices, True)
            await resp.write_eof()
        except ConnectionResetError:
            _mark_delivered(choices, False)
        except BaseException:
            _mark_delivered(choices, False)
            raise
        return resp

    async def _sse(
        self, request: web.Request, frames: Any, error_frame: Any, finals: list[ChoiceOut]
    ) -> web.StreamResponse:
        """Write `frames` (an async iterator of bytes) as they come. Once streaming began the status is sent, so a
        generation failure becomes an error event. The choices collected in `finals` count as delivered once their
        last frames are handed to the connection."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            async for frame in frames:
                _mark_delivered(finals, True)
                await resp.write(frame)
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            _mark_delivered(finals, False)
            raise  # the client went away; stream_deltas cancels the generation
        except Exception as exc:
            _mark_delivered(finals, False)
            refused = _refusal(exc)  # the status is sent: the event names whose fault it was
            message = refused or f"generation failed: {type(exc).__name__}: {exc}"
            await resp.write(error_frame(message, client_fault=refused is not None))
            await resp.write_eof()
        return resp

    def _live(
        self,
        session: Session,
        prompt: _Prompt,
        params: GenerationParams,
        *,
        parse_tools: bool,
        rid: str,
        with_pieces: bool,
        finals: list[ChoiceOut],
    ) -> Any:
        """The deltas of a streamed generation; each choice's final result is appended to `finals`."""
        streams = [TextStream(self.tokenizer, params.stop, parse_tools) for _ in range(params.n)]
        deltas = stream_deltas(
            lambda callbacks: self._generate(
                session, prompt, params, parse_tools=parse_tools, rid=rid, want_pieces=False, on_tokens=callbacks
            ),
            streams,
            with_pieces=with_pieces,
        )
        return _collect_finals(deltas, finals)

    # -- OpenAI ------------------------------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session(request)
            body = await self._body(request)
            params = generation_params(
                body, self._max_tokens(session), max_tokens_keys=("max_completion_tokens", "max_tokens")
            )
            params.logprobs = bool(body.get("logprobs", False))
            messages = normalize_messages(body.get("messages"))
            tools = normalize_tools(body.get("tools"))
            parse_tools = tool_choice_allows_calls(body.get("tool_choice"), tools)
            prompt = await self._chat_prompt(session, messages, tools)
        except _Unauthorized as exc:
            return _openai_error(str(exc), 401, "authentication_error")
        except BadRequest as exc:
            return _openai_error(str(exc), 400, param=exc.param)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        model = str(body.get("model") or self.config.model_name)
        if params.stream:
            finals: list[ChoiceOut] = []
            deltas = self._live(
                session, prompt, params, parse_tools=parse_tools, rid=rid, with_pieces=params.logprobs, finals=finals
            )
            return await self._sse(
                request,
                _data_frames(chat_stream(rid, model, deltas, params.n, len(prompt.ids), params)),
                _openai_error_frame,
                finals,
            )
        try:
            choices = await self._generate(
                session, prompt, params, parse_tools=parse_tools, rid=rid, want_pieces=params.logprobs
            )
        except Exception as exc:  # the engine pool's failure: the agent sees a server error, as with a real API
            return _openai_failure(exc)
        return await self._deliver(
            request, chat_completion(rid, model, choices, len(prompt.ids), params.logprobs), choices
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session(request)
            body = await self._body(request)
            params = generation_params(body, 16, max_tokens_keys=("max_tokens",))  # OpenAI's default is 16
            logprobs = body.get("logprobs")
            if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
                raise BadRequest("'logprobs' must be an integer (top logprobs count) or null", "logprobs")
            params.logprobs = logprobs is not None
            if body.get("echo"):
                raise BadRequest("'echo' is not supported", "echo")
            prompt_ids = self._completion_prompt(body.get("prompt"))
        except _Unauthorized as exc:
            return _openai_error(str(exc), 401, "authentication_error")
        except BadRequest as exc:
            return _openai_error(str(exc), 400, param=exc.param)
        parent = session.token_parent(prompt_ids)
        prompt = _Prompt(
            ids=prompt_ids,
            parent=parent.key if parent else None,
            # A prompt that extends a recorded completion holds its images' tokens: it keeps its images too.
            vision=continued(parent.vision, len(parent.full_ids), None, len(prompt_ids) - len(parent.full_ids))
            if parent is not None
            else None,
        )
        rid = f"cmpl-{uuid.uuid4().hex}"
        model = str(body.get("model") or self.config.model_name)
        if params.stream:
            finals: list[ChoiceOut] = []
            deltas = self._live(session, prompt, params, parse_tools=False, rid=rid, with_pieces=False, finals=finals)
            return await self._sse(request, _data_frames(text_stream(rid, model, deltas)), _openai_error_frame, finals)
        try:
            choices = await self._generate(
                session, prompt, params, parse_tools=False, rid=rid, want_pieces=params.logprobs
            )
        except Exception as exc:
            return _openai_failure(exc)
        return await self._deliver(
            request, text_completion(rid, model, choices, len(prompt_ids), params.logprobs), choices
        )

    def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            return self.prompts.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.vocab_size
            bad = next((t for t in prompt if t < 0 or (vocab is not None and t >= vocab)), None)
            if bad is not None:  # the engine would refuse it too; said here, before a generation is queued
                span = f"[0, {vocab})" if vocab is not None else "non-negative"
                raise BadRequest(f"'prompt' token id {bad} is out of the vocabulary range {span}", "prompt")
            return list(prompt)
        raise BadRequest("'prompt' must be one non-empty string or one list of token ids (no batches)", "prompt")

    async def models(self, request: web.Request) -> web.Response:
        return _json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.config.model_name:  # OpenAI: 404 model_not_found
            return _openai_error(f"The model '{name}' does not exist", 404, param="model", code="model_not_found")
        return _json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "rollq"}

    async def health(self, request: web.Request) -> web.Response:
        return _json_response({"status": "ok"})  # unauthenticated: says nothing about the episodes it serves

    # -- Anthropic ---------------------------------------------------------------------------------------------------

    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session(request)
            body = await self._body(request)
            params = anthropic.generation_params(body)
            messages = anthropic.normalize_messages(body)
            tools = anthropic.normalize_tools(body.get("tools"))
            parse_tools = anthropic.tool_choice_allows_calls(body.get("tool_choice"), tools)
            prompt = await self._chat_prompt(session, messages, tools)
        except _Unauthorized as exc:
            return _anthropic_error(str(exc), 401, "authentication_error")
        except BadRequest as exc:
            return _anthropic_error(str(exc), 400)
        mid = anthropic.new_message_id()
        model = str(body.get("model") or self.config.model_name)
        if params.stream:
            finals: list[ChoiceOut] = []
            deltas = self._live(
                session, prompt, params, parse_tools=parse_tools, rid=mid, with_pieces=False, finals=finals
            )
            events = anthropic.stream_events(mid, model, deltas, len(prompt.ids), params.stop)
            return await self._sse(request, _event_frames(events), _anthropic_error_frame, finals)
        try:
            [choice] = await self._generate(
                session, prompt, params, parse_tools=parse_tools, rid=mid, want_pieces=False
            )
        except Exception as exc:
            refused = _refusal(exc)
            if refused is not None:
                return _anthropic_error(refused, 400)
            return _anthropic_error(f"generation failed: {type(exc).__name__}: {exc}", 502, "api_error")
        return await self._deliver(
            request, anthropic.message(mid, model, choice, len(prompt.ids), params.stop), [choice]
        )

    # -- OpenAI Responses --------------------------------------------------------------------------------------------

    async def responses(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._session(request)
            body = await self._body(request)
            req = responses.parse_request(body, self._max_tokens(session))
            history: list[Any] = []
            if req.previous_response_id is not None:
                history = self._response_history(session, req.previous_response_id)
            conversation = history + req.input
            prompt = await self._chat_prompt(session, req.messages(history), req.tools)
        except _Unauthorized as exc:
            return _openai_error(str(exc), 401, "authentication_error")
        except BadRequest as exc:
            return _openai_error(str(exc), 400, param=exc.param)
        rid = responses.new_response_id()
        model = str(body.get("model") or self.config.model_name)
        params = req.params

        def remember(choice: ChoiceOut) -> None:
            session.response_inputs[rid] = conversation

        if params.stream:
            finals: list[ChoiceOut] = []
            deltas = self._live(
                session,
                prompt,
                params,
                parse_tools=req.parse_tools,
                rid=rid,
                with_pieces=params.logprobs,
                finals=finals,
            )
            events = responses.stream_events(rid, model, req, deltas, len(prompt.ids), remember)
            return await self._sse(request, _event_frames(events), responses.error_frame, finals)
        try:
            [choice] = await self._generate(
                session, prompt, params, parse_tools=req.parse_tools, rid=rid, want_pieces=params.logprobs
            )
        except Exception as exc:
            return _openai_failure(exc)
        remember(choice)
        return await self._deliver(request, responses.response(rid, model, req, choice, len(prompt.ids)), [choice])

    @staticmethod
    def _response_history(session: Session, response_id: str) -> list[Any]:
        """The conversation of an earlier response of this episode, its reply included (instructions are not
        carried over, as with OpenAI)."""
        record = session.records.get(response_id)
        inputs = session.response_inputs.get(response_id)
        if record is None or inputs is None or not record.delivered:
            raise BadRequest(
                f"previous_response_id {response_id!r} is not a response of this episode", "previous_response_id"
            )
        return [*inputs, record.reply]


def _mark_delivered(choices: list[ChoiceOut], delivered: bool) -> None:
    for choice in choices:
        if choice.record is not None:
            choice.record.delivered = delivered


async def _collect_finals(deltas: Any, finals: list[ChoiceOut]) -> Any:
    async for delta in deltas:
        if delta.final is not None:
            finals.append(delta.final)
        yield delta


async def _data_frames(chunks: Any) -> Any:
    async for chunk in chunks:
        yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
    yield b"data: [DONE]\n\n"


async def _event_frames(events: Any) -> Any:
    async for name, data in events:
        yield b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


def _openai_failure(exc: Exception) -> web.Response:
    refused = _refusal(exc)
    if refused is not None:
        return _openai_error(refused, 400)
    return _openai_error(f"generation failed: {type(exc).__name__}: {exc}", 502, "server_error")


def _openai_error_frame(message: str, client_fault: bool = False) -> bytes:
    kind = "invalid_request_error" if client_fault else "server_error"
    return b"data: " + msgspec.json.encode({"error": {"message": message, "type": kind}}) + b"\n\n"


def _anthropic_error_frame(message: str, client_fault: bool = False) -> bytes:
    body = {
        "type": "error",
        "error": {"type": "invalid_request_error" if client_fault else "api_error", "message": message},
    }
    return b"event: error\ndata: " + msgspec.json.encode(body) + b"\n\n"


__all__ = ["ProxyConfig", "RecordingProxy"]
