"""HTTP client for one SGLang-protocol engine (SGLang 0.5.5 and 0.5.23, or rollq's reference/synthetic engine).

Token-in/token-out: requests carry `input_ids`, answers are parsed into GenerateResult. Connections come from one
shared keep-alive `aiohttp.ClientSession` per process (see `engine.http.shared_http_session`)."""

from __future__ import annotations

import json as jsonlib
from typing import Any, Literal

import aiohttp
import msgspec

import rollq.tracing as tracing
from rollq.engine.types import (
    ADMIN_ROUTES,
    FinishReason,
    GenerateResult,
    PauseMode,
    ProgressCallback,
    SamplingParams,
)

SNIPPET_CHARS = 300  # of a body quoted in an error message


class EngineError(Exception):
    """The engine answered, with an error (4xx): the request itself is wrong; retrying elsewhere won't help.
    The text names the engine, the route (when known), the HTTP status and the engine's message."""

    def __init__(self, url: str, status: int, message: str, route: str = "") -> None:
        message = message or "(no message)"
        if status in (401, 403):  # the engine's own answer is a bare "Unauthorized": say which setting to fix
            if route in ADMIN_ROUTES:
                hint = (
                    " on a control route: set engine_admin_api_key to the engine's admin_api_key (or engine_api_key "
                    "to its api_key when it has none): ROLLQ_TRAINER_ENGINE_ADMIN_API_KEY, "
                    "ROLLQ_WORKER_ENGINE_ADMIN_API_KEY"
                )
            else:
                hint = (
                    ": set engine_api_key to the engine's api_key: ROLLQ_TRAINER_ENGINE_API_KEY, "
                    "ROLLQ_WORKER_ENGINE_API_KEY"
                )
            message = f"{message} (the engine refused the key sent{hint})"
        super().__init__(f"{url}{route}: HTTP {status}: {message}")
        self.url = url
        self.route = route
        self.status = status
        self.message = message


class EngineUnavailable(Exception):
    """The engine did not answer, or answered 5xx: it may be dead; the request can go to another engine.
    The text names the engine, the route (when known) and the reason (the HTTP status for a 5xx).

    `unreachable`: the connection itself failed (refused, reset, closed mid-answer): the process is gone. Otherwise
    it was slow or answered 5xx, which a paused or updating SGLang does (/health_generate: 503 after 20 s)."""

    def __init__(self, url: str, reason: str, *, unreachable: bool = False, route: str = "") -> None:
        super().__init__(f"{url}{route}: {reason}")
        self.url = url
        self.route = route
        self.reason = reason
        self.unreachable = unreachable


HealthStatus = Literal["ok", "busy", "down"]


def _unavailable(url: str, exc: BaseException, what: str = "", route: str = "") -> EngineUnavailable:
    # A timeout is not "unreachable" (the engine may be loading weights); a refused or dropped connection is.
    unreachable = not isinstance(exc, TimeoutError) and isinstance(exc, aiohttp.ClientError | OSError)
    return EngineUnavailable(url, f"{what}{type(exc).__name__}: {exc}", unreachable=unreachable, route=route)


def _stream_error(url: str, error: Any) -> EngineError:
    """SGLang reports a streamed request's error (validation, duplicate rid, context too long) as HTTP 200 and
    `data: {"error": {"message", "type", "code", "retryable"}}`: the request's error, not the engine's."""
    code = error.get("code") if isinstance(error, dict) else None
    status = code if isinstance(code, int) and 400 <= code < 600 else 400
    return EngineError(url, status, error_message({"error": error}), "/generate")


def _abort_error(url: str, result: GenerateResult) -> EngineError | EngineUnavailable | None:
    """An abort carrying a status_code is an engine-side error (SGLang answers it as HTTP 400/5xx when not streamed,
    as an ordinary abort chunk when streamed): 4xx is the request's fault, 5xx the engine's."""
    finish = result.finish_reason
    if finish is None or finish.type != "abort" or finish.status_code is None or not 400 <= finish.status_code < 600:
        return None
    message = finish.message or "aborted"
    if finish.status_code >= 500:
        return EngineUnavailable(url, f"HTTP {finish.status_code}: {message}", route="/generate")
    return EngineError(url, finish.status_code, message, "/generate")


def error_message(body: Any) -> str:
    """SGLang's error shapes: {"message"}, {"error": {"message"}}, {"error": "text"}."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "message" in body:
            return str(body["message"])
        if body.get("error_message"):  # the LoRA routes' LoRAUpdateOutput (io_struct.py:1497-1504)
            return str(body["error_message"])
    return str(body).strip()[:SNIPPET_CHARS] if body else ""


def parse_generate(body: dict[str, Any]) -> GenerateResult:
    meta = body.get("meta_info") or {}
    finish = meta.get("finish_reason")
    logprobs = [float(t[0]) if t[0] is not None else 0.0 for t in meta.get("output_token_logprobs") or []]
    return GenerateResult(
        rid=str(meta.get("id", "")),
        output_ids=list(body.get("output_ids") or []),
        output_logprobs=logprobs,
        finish_reason=msgspec.convert(finish, FinishReason) if finish else None,
        weight_version=str(meta.get("weight_version", "default")),
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        text=body.get("text"),
        meta_info=meta,
    )


def _json_or_text(reply: _Reply) -> Any:
    try:
        return reply.json()
    except ValueError:
        return reply.text


class _Reply:
    __slots__ = ("status", "reason", "content")

    def __init__(self, status: int, content: bytes, reason: str | None = None) -> None:
        self.status = status
        self.reason = reason or ""  # the status line's phrase ("Not Found"): what an empty body leaves to say
        self.content = content

    def json(self) -> Any:
        try:
            return _decode(self.content)  # msgspec: ~5x faster than json.loads on a /generate answer
        except msgspec.DecodeError:  # what msgspec refuses (NaN, huge numbers, invalid JSON): as json.loads does
            return jsonlib.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    @property
    def snippet(self) -> str:
        """The body for an error message: its start, or the status phrase when it is empty."""
        return self.text.strip()[:SNIPPET_CHARS] or self.reason or "(empty body)"

    def status_text(self) -> str:
        """`HTTP 503: <the message of a JSON error body, or the body, or the phrase>`: what an EngineUnavailable says
        of a 5xx (an engine error's message, as SGLang and rollq's engines answer it, rather than its JSON)."""
        try:
            body = self.json()
        except ValueError:
            body = None
        said = error_message(body) if isinstance(body, dict) and ("message" in body or "error" in body) else ""
        return f"HTTP {self.status}: {said[:SNIPPET_CHARS] or self.snippet}"


def _refusal(url: str, reply: _Reply, route: str, body: Any = None) -> EngineError:
    """An error answer (or a success the caller cannot accept) as EngineError: the engine's message when the body
    has one, else the body itself, else (empty, `{}`) the status phrase: never an empty reason or `{}`."""
    message = error_message(_json_or_text(reply) if body is None else body)
    return EngineError(url, reply.status, message or reply.reason or "(empty body)", route)


def _not_json(url: str, reply: _Reply, route: str, wanted: str = "a JSON object") -> EngineError:
    """A 2xx whose body is not what the route answers (a proxy's page, a router's own reply): name what came."""
    return EngineError(url, reply.status, f"expected {wanted}, got: {reply.snippet}", route)


_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def _json_body(payload: Any, headers: dict[str, str]) -> dict[str, Any]:
    """aiohttp request arguments for a JSON body, encoded by msgspec (~10x faster than aiohttp's json.dumps on a
    prompt's input_ids)."""
    return {"data": _encode(payload), "headers": {**headers, "Content-Type": "application/json"}}


class SGLangClient:
    def __init__(
        self, url: str, http: aiohttp.ClientSession, *, api_key: str | None = None, admin_api_key: str | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.http = http
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # control routes take the admin key when the server has one (then the api key does not open them)
        self.admin_headers = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else self.headers

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        timeout: float | None = 30.0,
        headers: dict[str, str] | None = None,  # None: the route's (the admin key's on control routes)
    ) -> _Reply:
        try:
            if headers is None:
                headers = self.admin_headers if path in ADMIN_ROUTES else self.headers
            body = _json_body(json, headers) if json is not None else {"headers": headers}
            async with self.http.request(
                method, self.url + path, timeout=aiohttp.ClientTimeout(total=timeout, connect=5.0), **body
            ) as resp:
                reply = _Reply(resp.status, await resp.read(), resp.reason)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _unavailable(self.url, exc, route=path) from None
        if reply.status >= 500:
            raise EngineUnavailable(self.url, reply.status_text(), route=path)
        return reply

    async def _json(self, method: str, path: str, *, json: Any = None, timeout: float | None = 30.0) -> Any:
        resp = await self._request(method, path, json=json, timeout=timeout)
        if resp.status >= 400:
            raise _refusal(self.url, resp, path)
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text

    async def _json_object(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        timeout: float | None = 30.0,
        first_of_list: bool = False,  # /generate with n > 1 answers a list; callers ask for one sample per call
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """A route that answers a JSON object (/generate, the info routes): anything else (a proxy's page, a router's
        reply of another shape) is an EngineError naming the engine, the route, the status and the body."""
        resp = await self._request(method, path, json=json, timeout=timeout, headers=headers)
        if resp.status >= 400:
            raise _refusal(self.url, resp, path)
        try:
            body = resp.json()
        except ValueError:
            body = None
        if first_of_list and isinstance(body, list) and body:
            body = body[0]
        if not isinstance(body, dict):
            raise _not_json(self.url, resp, path)
        return body

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        timeout: float | None = None,  # None: a paused engine keeps the call open until it resumes
        on_progress: ProgressCallback | None = None,  # streams the request and reports tokens as they come
        priority: int | None = None,
        lora_path: str | None = None,  # a LoRA adapter's name (SGLang's field name); None: the base model
        image_data: list[str] | None = None,  # SGLang's image_data: one per image placeholder in input_ids
        headers: dict[str, str] | None = None,  # more request headers (a gateway's routing key)
    ) -> GenerateResult:
        payload: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling.to_request(),
            "return_logprob": return_logprob,
        }
        if rid:
            payload["rid"] = rid
        if lora_path:
            payload["lora_path"] = lora_path
        if image_data:
            payload["image_data"] = image_data
        if priority is not None:
            payload["priority"] = priority
        headers = {**self._generate_headers(), **headers} if headers else self._generate_headers()
        if on_progress is not None:
            result = await self._generate_stream(payload, timeout, on_progress, headers)
        else:
            body = await self._json_object(
                "POST", "/generate", json=payload, timeout=timeout, first_of_list=True, headers=headers
            )
            result = parse_generate(body)
        error = _abort_error(self.url, result)
        if error is not None:
            raise error
        return result

    def _generate_headers(self) -> dict[str, str]:
        """/generate's headers: with the caller's span as `traceparent` when the task traces (rollq.tracing). SGLang run
        with --enable-trace makes its request's spans children of it (the W3C headers it reads: sglang 0.5.23
        srt/observability/trace.py:41,74 and srt/managers/tokenizer_manager.py:3805-3814), so one trace shows the
        sample inside the engine too."""
        parent = tracing.traceparent() if tracing.active() is not None else ""
        return {**self.headers, tracing.TRACEPARENT: parent} if parent else self.headers

    async def _generate_stream(
        self, payload: dict[str, Any], timeout: float | None, on_progress: ProgressCallback, headers: dict[str, str]
    ) -> GenerateResult:
        """`stream: true`: chunks carry the cumulative output_ids and logprobs (SGLang 0.5.23 and rollq's engines;
        0.5.5 sends deltas and may drop chunks — stream only against the former). The last chunk is the result."""
        payload = {**payload, "stream": True}
        last: dict[str, Any] | None = None
        error: Any = None
        seen = 0
        try:
            async with self.http.post(
                self.url + "/generate",
                timeout=aiohttp.ClientTimeout(total=timeout, connect=5.0),
                **_json_body(payload, headers),
            ) as resp:
                if resp.status >= 400:
                    reply = _Reply(resp.status, await resp.read(), resp.reason)
                    if resp.status >= 500:
                        raise EngineUnavailable(self.url, reply.status_text(), route="/generate")
                    raise _refusal(self.url, reply, "/generate")
                buffer = b""
                while True:
                    data = await resp.content.readany()  # no line-length limit: a chunk holds the whole output
                    if not data:
                        break
                    buffer += data
                    *events, buffer = buffer.split(b"\n\n")
                    for event in events:
                        if not event.startswith(b"data: ") or event == b"data: [DONE]":
                            continue
                        chunk = jsonlib.loads(event[6:])
                        if "error" in chunk:
                            error = chunk["error"]  # raised outside the try: it is not a broken stream
                            break
                        ids = chunk.get("output_ids") or []
                        if len(ids) > seen:
                            entries = (chunk.get("meta_info") or {}).get("output_token_logprobs") or []
                            lps = [float(e[0]) if e[0] is not None else 0.0 for e in entries[seen : len(ids)]]
                            on_progress(ids[seen:], lps + [0.0] * (len(ids) - seen - len(lps)))
                            seen = len(ids)
                        last = chunk
                    if error is not None:
                        break
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            raise _unavailable(self.url, exc, "stream broke: ", "/generate") from None
        if error is not None:
            raise _stream_error(self.url, error)
        if last is None or (last.get("meta_info") or {}).get("finish_reason") is None:
            raise EngineUnavailable(self.url, "stream ended before the request finished", route="/generate")
        return parse_generate(last)

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        # 0.5.5 takes no body and ignores one; 0.5.23 reads the mode.
        await self._json("POST", "/pause_generation", json={"mode": mode}, timeout=None)

    async def continue_generation(self) -> None:
        await self._json("POST", "/continue_generation", json={})

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if flush_cache is not None:
            payload["flush_cache"] = flush_cache
        return await self._success_call("/update_weights_from_disk", payload, timeout)

    # --- delta weight sync (rollq's engines and the SGLang host agent, `rollq weight-agent`; docs/weight-sync.md) ---

    async def _admin_success_call(self, path: str, payload: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        """A `{"success", "message"}` control route of rollq's own (not in SGLang's list of admin routes): the admin
        key, 4xx (404: the server has no such route, 409: the delta does not apply) as EngineError."""
        resp = await self._request("POST", path, json=payload, timeout=timeout, headers=self.admin_headers)
        return self._success_body(resp, path)

    def _success_body(self, resp: _Reply, path: str) -> dict[str, Any]:
        """The `{"success": true, ...}` answer of a control route; a refusal (4xx, or success false) as EngineError,
        an answer that is not such JSON as EngineUnavailable."""
        try:
            body = resp.json() if resp.content else {}
        except ValueError:
            body = {"message": resp.text.strip()[:SNIPPET_CHARS]}
        if resp.status < 400 and not (isinstance(body, dict) and "success" in body):
            raise _not_json(self.url, resp, path, 'a JSON {"success": ...} answer')
        if resp.status >= 400 or not body.get("success"):
            raise _refusal(self.url, resp, path, body)
        return body

    async def prepare_weights(
        self,
        weight_version: str,
        *,
        model_path: str | None = None,
        group_name: str | None = None,
        manifest: Any = None,
        timeout: float | None = 300.0,
    ) -> dict[str, Any]:
        """POST /rollq/prepare_weights: stage `weight_version` before the pause, from a delta (or full) directory
        (`model_path`, disk form) or from a blob broadcast over `group_name` described by `manifest` (distributed
        form). Answers `load_path` (what /update_weights_from_disk swaps in), `prepare_seconds`, `bytes_read`; a 404
        (no such route: the engine cannot prepare) or 409 (not the delta's base) is an EngineError of that status."""
        payload: dict[str, Any] = {"weight_version": weight_version}
        if model_path is not None:
            payload["model_path"] = model_path
        if group_name is not None:
            payload["group_name"] = group_name
            payload["manifest"] = msgspec.to_builtins(manifest)
        return await self._admin_success_call("/rollq/prepare_weights", payload, timeout)

    async def swap_prepared_weights(
        self, weight_version: str, *, flush_cache: bool = True, timeout: float | None = 120.0
    ) -> dict[str, Any]:
        """POST /rollq/swap_prepared_weights (distributed form of the swap): serve what was staged for
        `weight_version` (409 when nothing is)."""
        payload = {"weight_version": weight_version, "flush_cache": flush_cache}
        return await self._admin_success_call("/rollq/swap_prepared_weights", payload, timeout)

    async def weights_checksum(self, *, timeout: float | None = 120.0) -> dict[str, Any]:
        """GET /rollq/weights_checksum: `{"weight_version", "dtype", "checksums": {name: xxh3-128 hex}}` of the
        parameters the engine serves (rollq's engines)."""
        return await self._json_object("GET", "/rollq/weights_checksum", timeout=timeout, headers=self.admin_headers)

    async def flush_cache(self) -> None:
        """SGLang answers 200 (plain text "Cache flushed.") or 400 (not flushed: requests are queued or running).
        sglang-router answers 206 `{"status": "partial_success", ...}` when some of its engines refused: anything but
        a 200, or a JSON status other than success, is a cache that was not flushed."""
        resp = await self._request("POST", "/flush_cache")
        body = _json_or_text(resp) if resp.content else None
        outcome = body.get("status") if isinstance(body, dict) else None
        if resp.status != 200 or outcome not in (None, "success", "ok"):
            message = error_message(body) or resp.snippet
            raise EngineError(self.url, resp.status, f"{outcome}: {message}" if outcome else message, "/flush_cache")

    async def abort_request(self, rid: str = "", *, abort_all: bool = False) -> None:
        await self._json("POST", "/abort_request", json={"rid": rid, "abort_all": abort_all})

    async def health_generate(self, timeout: float = 10.0) -> bool:
        return await self.health_status(timeout) == "ok"

    async def health_status(self, timeout: float = 10.0) -> HealthStatus:
        """/health_generate as ok | busy (slow or 503: a paused or updating SGLang blocks it up to 20 s, then answers
        503) | down (the connection failed: the process is gone)."""
        try:
            resp = await self._request("GET", "/health_generate", timeout=timeout)
        except EngineUnavailable as exc:
            return "down" if exc.unreachable else "busy"
        return "ok" if resp.status == 200 else "busy"

    async def _get_with_fallback(self, new: str, old: str) -> dict[str, Any]:
        try:
            return await self._json_object("GET", new)
        except EngineError as exc:
            if exc.status != 404:
                raise
            return await self._json_object("GET", old)

    async def model_info(self) -> dict[str, Any]:
        return await self._get_with_fallback("/model_info", "/get_model_info")

    async def server_info(self) -> dict[str, Any]:
        return await self._get_with_fallback("/server_info", "/get_server_info")

    async def weight_version(self) -> str:
        info = await self.model_info()
        if "weight_version" in info:
            return str(info["weight_version"])
        reply = await self._json_object("GET", "/get_weight_version")
        if "weight_version" not in reply:
            got = str(reply)[:SNIPPET_CHARS]
            raise EngineError(self.url, 200, f"expected a weight_version, got: {got}", "/get_weight_version")
        return str(reply["weight_version"])

    async def metrics_text(self, *, timeout: float | None = 10.0) -> str:
        """The engine's Prometheus text (`/metrics`: open; SGLang serves it with --enable-metrics, else 404)."""
        resp = await self._request("GET", "/metrics", timeout=timeout)
        if resp.status >= 400:
            raise _refusal(self.url, resp, "/metrics")
        return resp.text

    # --- LoRA adapters (SGLang 0.5.5: http_server.py:949-980; names listed by /v1/models) ---

    async def _adapter_call(self, path: str, payload: dict[str, Any], timeout: float | None) -> dict[str, str]:
        """`{success, error_message, loaded_adapters}` routes: the adapters loaded after the call (name -> path)."""
        body = self._success_body(await self._request("POST", path, json=payload, timeout=timeout), path)
        loaded = body.get("loaded_adapters") or {}
        return {str(k): str(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {}

    async def load_lora_adapter(self, name: str, path: str, *, timeout: float | None = 120.0) -> dict[str, str]:
        return await self._adapter_call("/load_lora_adapter", {"lora_name": name, "lora_path": path}, timeout)

    async def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> dict[str, str]:
        """Returns once the requests in flight on it finished (None: however long they take)."""
        return await self._adapter_call("/unload_lora_adapter", {"lora_name": name}, timeout)

    async def adapters(self) -> list[str]:
        """The names of the adapters the engine serves (/v1/models' cards with a `parent`)."""
        body = await self._json_object("GET", "/v1/models")
        cards = body.get("data")
        if not isinstance(cards, list):
            return []
        return [str(c["id"]) for c in cards if isinstance(c, dict) and c.get("parent") and "id" in c]

    # --- the distributed weight update path (SGLang 0.5.23; see rollq.engine.weight_group) ---

    async def _success_call(self, path: str, payload: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        """`{"success", "message"}` routes: 400 or success false: EngineError; no answer or 5xx: EngineUnavailable."""
        resp = await self._request("POST", path, json=payload, timeout=timeout)
        try:
            body = resp.json() if resp.content else {}
        except ValueError:  # a proxy's plain-text page: quoted in the error, never a bare JSONDecodeError
            body = {"message": resp.text.strip()[:SNIPPET_CHARS]}
        if resp.status < 400 and not (isinstance(body, dict) and "success" in body):
            raise _not_json(self.url, resp, path, 'a JSON {"success": ...} answer')  # a router's or proxy's own reply
        if resp.status >= 400 or not body.get("success"):
            raise _refusal(self.url, resp, path, body)
        return body

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        *,
        backend: str = "nccl",
        timeout_s: float | None = None,  # rollq's engines bound the join and each receive by it; SGLang ignores it
        timeout: float | None = None,  # the HTTP call (the engine answers once every rank joined): timeout_s + 10
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        if timeout_s is not None:
            payload["timeout_s"] = timeout_s
        if timeout is None and timeout_s is not None:
            timeout = timeout_s + 10.0
        return await self._success_call("/init_weights_update_group", payload, timeout)

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group", *, timeout: float | None = 30.0
    ) -> dict[str, Any]:
        return await self._success_call("/destroy_weights_update_group", {"group_name": group_name}, timeout)

    async def begin_weight_update(self, *, timeout: float | None = 30.0) -> dict[str, Any]:
        return await self._success_call("/begin_weight_update", {}, timeout)

    async def end_weight_update(self, *, timeout: float | None = 30.0) -> dict[str, Any]:
        return await self._success_call("/end_weight_update", {}, timeout)

    async def update_weights_from_distributed(
        self, payload: dict[str, Any], *, timeout: float | None = None
    ) -> dict[str, Any]:
        """`payload`: names, dtypes, shapes, group_name, weight_version, flush_cache, abort_all_requests. The engine
        answers after receiving the broadcast and loading it (timeout None: the caller bounds the wait)."""
        return await self._success_call("/update_weights_from_distributed", payload, timeout)
