"""SGLang HTTP protocol conformance of rollq.engine.server.app, field by field, against the synthetic backend with raw
httpx (the protocol as rollq relies on it: docs/sglang-protocol.md)."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal

import httpx
import pytest

from rollq.engine.server.app import ServerHandle
from rollq.engine.server.synthetic import LengthDist
from rollq.engine.server.weights_root import OUTSIDE
from tests.helpers import wait_until

PROMPT = [5, 6, 7, 8]
VALIDATION_KEYS = {"object": "error", "type": "Bad Request", "param": None, "code": 400}


def gen_body(max_new_tokens: int = 8, prompt: list[int] | None = None, **extra) -> dict:
    return {
        "input_ids": prompt or PROMPT,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        **extra,
    }


async def generate(http: httpx.AsyncClient, url: str, body: dict) -> httpx.Response:
    return await http.post(url + "/generate", json=body)


async def tokens_made(handle: ServerHandle, rid: str, at_least: int = 1) -> None:
    """Wait until `rid` is running on the server and has produced `at_least` tokens."""

    def ready() -> bool:
        req = handle.server.states.get(rid)
        return req is not None and len(req.state.output_ids) >= at_least

    await wait_until(ready, 10, 0.005, what=f"{rid} to produce {at_least} tokens")


async def still_pending(task: asyncio.Task, for_s: float = 0.3) -> bool:
    try:
        await asyncio.wait_for(asyncio.shield(task), for_s)
    except TimeoutError:
        return True
    return False


# --- /generate shapes ---


async def test_generate_single_request_fields(engine, http):
    resp = await generate(http, engine.url, gen_body(6, rid="r-1", return_logprob=True))
    assert resp.status_code == 200
    body = resp.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["id"] == "r-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 6 and meta["cached_tokens"] == 0
    assert meta["weight_version"] == "default"
    assert meta["input_token_logprobs"] == []
    assert isinstance(meta["e2e_latency"], float)
    assert "weight_versions" not in meta
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == body["output_ids"] and len(body["output_ids"]) == 6
    assert all(isinstance(t[0], float) and t[0] < 0 and t[2] is None for t in triples)
    # Deterministic: the same prompt gives the same tokens and logprobs; no logprobs unless asked.
    again = (await generate(http, engine.url, gen_body(6))).json()
    assert again["output_ids"] == body["output_ids"]
    assert "output_token_logprobs" not in again["meta_info"] and len(again["meta_info"]["id"]) == 32


async def test_text_prompt_text_in_logprobs_and_put(engine, http):
    body = {
        "text": "hello",
        "sampling_params": {"max_new_tokens": 3},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
        "unknown_top_key": 1,
    }
    resp = await http.put(engine.url + "/generate", json=body)
    assert resp.status_code == 200
    out = resp.json()
    assert out["meta_info"]["prompt_tokens"] == len(b"hello")
    assert all(isinstance(t[2], str) for t in out["meta_info"]["output_token_logprobs"])
    assert len(out["meta_info"]["output_top_logprobs"]) == 3
    # `text` and the same prompt as ids give the same answer.
    ids = engine.server.backend.encode("hello")
    same = (await generate(http, engine.url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 3}})).json()
    assert same["output_ids"] == out["output_ids"] and same["text"] == out["text"]


async def test_batch_and_parallel_sampling_order_and_rids(engine, http):
    a, b = [11, 12, 13], [21, 22]
    single_a = await generate(http, engine.url, gen_body(5, a))
    single_b = await generate(http, engine.url, gen_body(5, b))
    batch = (await generate(http, engine.url, gen_body(5, [a, b], rid="batch"))).json()
    assert isinstance(batch, list) and [o["meta_info"]["id"] for o in batch] == ["batch_0", "batch_1"]
    assert [o["output_ids"] for o in batch] == [single_a.json()["output_ids"], single_b.json()["output_ids"]]
    listed = (await generate(http, engine.url, gen_body(5, [a, b], rid=["x", "y"]))).json()
    assert [o["meta_info"]["id"] for o in listed] == ["x", "y"]

    body = gen_body(5, [a, b], rid="par")
    body["sampling_params"]["n"] = 2
    par = (await generate(http, engine.url, body)).json()
    assert len(par) == 4  # prompt-major: a, a, b, b
    assert [o["output_ids"] for o in par] == [single_a.json()["output_ids"]] * 2 + [single_b.json()["output_ids"]] * 2
    rids = [o["meta_info"]["id"] for o in par]
    assert len(set(rids)) == 4 and all(len(r) == 32 and not r.startswith("par") for r in rids)
    one_n = gen_body(5, a)
    one_n["sampling_params"]["n"] = 3
    assert len((await generate(http, engine.url, one_n)).json()) == 3  # a single prompt with n > 1 answers a list
    per_prompt = {"input_ids": [a, b], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 4}]}
    assert [o["meta_info"]["completion_tokens"] for o in (await generate(http, engine.url, per_prompt)).json()] == [
        2,
        4,
    ]


async def test_stop_token_kept_in_ids_and_trimmed_from_text(engine, http):
    full = (await generate(http, engine.url, gen_body(40))).json()["output_ids"]
    k = next(i for i in range(1, 40) if full[i] not in full[:i])
    stop = full[k]
    body = gen_body(40)
    body["sampling_params"] = {"max_new_tokens": 40, "stop_token_ids": [stop]}
    out = (await generate(http, engine.url, body)).json()
    assert out["output_ids"] == full[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    decode = engine.server.backend.decode
    assert out["text"] == decode(full[:k])
    body["sampling_params"]["no_stop_trim"] = True
    assert (await generate(http, engine.url, body)).json()["text"] == decode(full[: k + 1])

    # Stop strings: ASCII bytes decode as themselves, so pick the first new printable character.
    chars = [chr((t - 3) & 0xFF) for t in full]
    j = next(i for i in range(1, 40) if chars[i].isascii() and chars[i].isalnum() and chars[i] not in decode(full[:i]))
    body["sampling_params"] = {"max_new_tokens": 40, "stop": chars[j]}
    out = (await generate(http, engine.url, body)).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": chars[j]}
    assert out["output_ids"] == full[: j + 1] and not out["text"].endswith(chars[j])


async def test_eos_from_length_distribution_and_ignore_eos(start_engine, http):
    handle = await start_engine(length=LengthDist(kind="fixed", length=4))
    out = (await generate(http, handle.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10}})).json()
    assert out["output_ids"][-1] == 2 and len(out["output_ids"]) == 4
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert (await generate(http, handle.url, gen_body(10))).json()["meta_info"]["completion_tokens"] == 10
    capped = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}
    assert (await generate(http, handle.url, capped)).json()["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 3,
    }
    zero = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}}
    assert (await generate(http, handle.url, zero)).json()["output_ids"] == []


async def test_skip_tokenizer_init_has_no_text(start_engine, http):
    handle = await start_engine(server={"skip_tokenizer_init": True})
    out = (await generate(http, handle.url, gen_body(3))).json()
    assert "text" not in out and len(out["output_ids"]) == 3
    resp = await generate(http, handle.url, {"text": "hi"})
    assert resp.status_code == 400 and "error" in resp.json()


async def test_streaming_chunks_are_cumulative_and_end_with_done(start_engine, http):
    handle = await start_engine(per_token_latency_s=0.003)
    async with http.stream(
        "POST", handle.url + "/generate", json=gen_body(12, stream=True, return_logprob=True)
    ) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = (await resp.aread()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert len(chunks) >= 2
    for prev, cur in itertools.pairwise(chunks):
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert cur["text"].startswith(prev["text"].rstrip("\ufffd"))
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert len(last["output_ids"]) == 12 and len(last["meta_info"]["output_token_logprobs"]) == 12
    plain = (await generate(http, handle.url, gen_body(12))).json()
    assert plain["output_ids"] == last["output_ids"]


# --- errors ---


async def test_error_shapes(start_engine, http):
    handle = await start_engine(context_length=64, per_token_latency_s=0.01)
    url = handle.url

    resp = await http.post(url + "/generate", content=b"{not json")
    assert resp.status_code == 400 and resp.json().items() >= VALIDATION_KEYS.items()
    assert isinstance(resp.json()["message"], str)
    resp = await generate(http, url, {"input_ids": "abc"})
    assert resp.status_code == 400 and resp.json().items() >= VALIDATION_KEYS.items()

    resp = await generate(http, url, {"input_ids": []})
    assert resp.status_code == 400 and resp.json() == {"error": {"message": "input_ids cannot be empty."}}
    resp = await generate(http, url, {"input_ids": list(range(3, 67))})
    assert resp.status_code == 400
    assert resp.json() == {
        "error": {"message": "The input (64 tokens) is longer than the model's context length (64 tokens)."}
    }
    # input + max_new_tokens > context is refused when max_new_tokens was given (tokenizer_manager.py:1353-1377)
    fits = {"input_ids": list(range(3, 63)), "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    assert (await generate(http, url, fits)).status_code == 200
    resp = await generate(http, url, {**fits, "sampling_params": {"max_new_tokens": 5}})
    assert resp.status_code == 400 and "You requested a total of 65 tokens" in resp.json()["error"]["message"]
    resp = await generate(http, url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "bogus": 1}})
    assert resp.status_code == 400 and "bogus" in resp.json()["error"]["message"]
    for bad, fragment in (
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"repetition_penalty": 3}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"min_new_tokens": 9, "max_new_tokens": 4}, "min_new_tokens"),
        ({"max_new_tokens": "x"}, "max_new_tokens"),
    ):
        resp = await generate(http, url, {"input_ids": PROMPT, "sampling_params": bad})
        assert resp.status_code == 400 and fragment in resp.json()["error"]["message"], bad
    nulls = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": None, "stop": None}}
    assert (await generate(http, url, nulls)).status_code == 200
    resp = await generate(http, url, {"input_ids": PROMPT, "text": "x"})
    assert resp.status_code == 400 and "Only one of" in resp.json()["error"]["message"]

    running = asyncio.create_task(generate(http, url, gen_body(50, rid="dup")))  # 0.5 s
    await tokens_made(handle, "dup")
    resp = await generate(http, url, gen_body(2, rid="dup"))
    assert resp.status_code == 400 and resp.json() == {"error": {"message": "Duplicate request ID detected: dup"}}
    await http.post(url + "/abort_request", json={"rid": "dup"})
    assert (await running).json()["meta_info"]["finish_reason"]["type"] == "abort"


async def test_api_key_guards_every_route_but_health_and_metrics(start_engine, http):
    handle = await start_engine(server={"api_key": "sekret"})
    url, good = handle.url, {"Authorization": "Bearer sekret"}
    for method, path in (
        ("POST", "/generate"),
        ("GET", "/model_info"),
        ("POST", "/pause_generation"),
        ("GET", "/server_info"),
        ("POST", "/abort_request"),
        ("GET", "/v1/models"),
    ):
        resp = await http.request(method, url + path, json={})
        assert resp.status_code == 401 and resp.json() == {"error": "Unauthorized"}, path
    resp = await http.post(url + "/generate", json=gen_body(2), headers={"Authorization": "Bearer wrong"})
    assert resp.status_code == 401
    assert (await http.post(url + "/generate", json=gen_body(2), headers=good)).status_code == 200
    for path in ("/health", "/health_generate", "/metrics"):
        assert (await http.get(url + path)).status_code == 200, path


# --- aborts and pauses ---


async def test_abort_request_reaches_only_an_exact_live_rid(start_engine, http):
    # tokenizer_manager.py:2241-2256 (0.5.23): forwarded only when the exact rid is live and not aborted before;
    # an empty rid without abort_all is ignored.
    handle = await start_engine(per_token_latency_s=0.005)
    url = handle.url
    tasks = {
        rid: asyncio.create_task(generate(http, url, gen_body(2000, [i + 3, 9], rid=rid)))
        for i, rid in enumerate(["grp-a-1", "grp-a-2", "other"])
    }
    for rid in tasks:
        await tokens_made(handle, rid, 3)
    for body in ({"rid": "grp-a", "abort_all": False}, {"rid": ""}, {}):
        resp = await http.post(url + "/abort_request", json=body)
        assert resp.status_code == 200 and resp.content == b""
    assert not any(t.done() for t in tasks.values())
    assert handle.server.counters["num_aborted_requests"] == 0
    await http.post(url + "/abort_request", json={"rid": "grp-a-1"})
    await http.post(url + "/abort_request", json={"rid": "grp-a-1"})  # a repeat is dropped
    body = (await asyncio.wait_for(tasks["grp-a-1"], 5)).json()
    assert body["meta_info"]["finish_reason"]["type"] == "abort"
    assert 3 <= len(body["output_ids"]) < 2000 and body["meta_info"]["prompt_tokens"] == 2
    assert handle.server.counters["num_aborted_requests"] == 1
    assert not tasks["grp-a-2"].done() and not tasks["other"].done()
    await http.post(url + "/abort_request", json={"abort_all": True})
    for rid in ("grp-a-2", "other"):
        assert (await asyncio.wait_for(tasks[rid], 5)).json()["meta_info"]["finish_reason"]["type"] == "abort"


async def test_generate_blocks_while_paused_and_completes_after_continue(start_engine, http):
    engine = await start_engine(server={"health_timeout_s": 0.3})
    url = engine.url
    resp = await http.post(url + "/pause_generation")  # no body: abort mode, like 0.5.5
    assert resp.status_code == 200 and resp.json() == {"message": "Generation paused successfully.", "status": "ok"}
    task = asyncio.create_task(generate(http, url, gen_body(5, rid="blocked")))
    assert await still_pending(task)
    metrics = (await http.get(url + "/metrics")).text
    assert 'sglang:num_queue_reqs{model_name="synthetic",engine_type="unified"} 1.0' in metrics
    # The health probe waits at the gate like any request and gives up: 503 (http_server.py:779-799); /ready is 503
    # while paused (tokenizer_manager.py:732-734).
    for path in ("/health_generate", "/health", "/ready"):
        assert (await http.get(url + path, timeout=5)).status_code == 503, path
    resp = await http.post(url + "/continue_generation", json={"torch_empty_cache": True})
    assert resp.status_code == 200 and resp.json() == {"message": "Generation continued successfully.", "status": "ok"}
    out = (await asyncio.wait_for(task, 5)).json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    for path in ("/health_generate", "/health", "/ready"):
        assert (await http.get(url + path, timeout=5)).status_code == 200, path


async def test_pause_abort_mode_returns_partial_outputs_and_aborts_waiting(start_engine, http):
    handle = await start_engine(per_token_latency_s=0.005)
    url = handle.url
    tasks = [asyncio.create_task(generate(http, url, gen_body(2000, [i + 3], rid=f"p{i}"))) for i in range(3)]
    for i in range(3):
        await tokens_made(handle, f"p{i}", 2)
    resp = await http.post(url + "/pause_generation", json={"mode": "abort"})
    assert resp.status_code == 200 and handle.server.running == 0  # returns once in-flight requests drained
    for task in tasks:
        out = await asyncio.wait_for(task, 5)
        assert out.status_code == 200
        meta = out.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and 2 <= meta["completion_tokens"] < 2000
    # A request held at the pause gate is not live: neither /abort_request nor abort_all reaches it, and it runs
    # after continue (tokenizer_manager.py:938-941, 2241-2256).
    held = asyncio.create_task(generate(http, url, gen_body(5, rid="w-1")))
    await wait_until(lambda: "w-1" in handle.server.states, what="w-1 held")
    await http.post(url + "/abort_request", json={"rid": "w-1"})
    await http.post(url + "/abort_request", json={"abort_all": True})
    assert await still_pending(held, 0.1)
    await http.post(url + "/continue_generation")
    assert (await asyncio.wait_for(held, 5)).json()["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


async def test_abort_in_waiting_queue_shape(start_engine, http):
    # One batch slot: the second request waits in the scheduler's queue. Aborted there it answers without
    # prompt_tokens, with text, weight_version and completion_tokens (tokenizer_manager.py:3596-3636).
    handle = await start_engine(per_token_latency_s=0.005, max_running_requests=1)
    url = handle.url
    first = asyncio.create_task(generate(http, url, gen_body(2000, rid="run")))
    await tokens_made(handle, "run")
    queued = asyncio.create_task(generate(http, url, gen_body(5, [7], rid="queued")))
    await wait_until(lambda: "queued" in handle.server.states and handle.server.states["queued"].started, what="queued")
    await http.post(url + "/abort_request", json={"rid": "queued"})
    body = (await asyncio.wait_for(queued, 5)).json()
    assert body["text"] == "" and body["output_ids"] == []
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert "prompt_tokens" not in meta and meta["completion_tokens"] == 0 and meta["weight_version"] == "default"
    await http.post(url + "/abort_request", json={"rid": "run"})
    await first


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_retract_and_in_place_keep_partial_tokens_deterministically(start_engine, http, mode):
    handle = await start_engine(per_token_latency_s=0.004)
    url = handle.url
    baseline = (await generate(http, url, gen_body(40, rid="base"))).json()["output_ids"]
    task = asyncio.create_task(generate(http, url, gen_body(40, rid="paused")))
    await tokens_made(handle, "paused", 5)
    resp = await http.post(url + "/pause_generation", json={"mode": mode})
    assert resp.status_code == 200 and resp.json()["status"] == "ok"
    frozen = len(handle.server.states["paused"].state.output_ids)
    assert await still_pending(task, 0.15)
    assert len(handle.server.states["paused"].state.output_ids) == frozen  # no decode step while paused
    assert 5 <= frozen < 40
    await http.post(url + "/continue_generation")
    out = (await asyncio.wait_for(task, 5)).json()
    assert out["output_ids"] == baseline
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    assert out["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)


# --- weights ---


async def test_update_weights_from_disk_sets_version(engine, http, tmp_path):
    url = engine.url
    resp = await http.post(
        url + "/update_weights_from_disk",
        json={"model_path": str(tmp_path), "weight_version": "v2", "load_format": None},
    )
    assert resp.status_code == 200
    body = resp.json()
    assert body.pop("load_seconds") >= 0  # rollq's extra key: the load itself, for fleet timing
    assert body == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to v2.",
        "num_paused_requests": 0,
    }
    assert (await http.get(url + "/get_weight_version")).status_code == 404  # removed in 0.5.23
    assert (await http.get(url + "/model_info")).json()["weight_version"] == "v2"
    assert (await generate(http, url, gen_body(2))).json()["meta_info"]["weight_version"] == "v2"

    resp = await http.post(
        url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "missing"), "weight_version": "v3"}
    )
    assert resp.status_code == 400  # a path that is not there gets the answer of one outside weights_root (no oracle)
    body = resp.json()
    assert body == {"success": False, "message": OUTSIDE, "num_paused_requests": 0}
    assert (await http.get(url + "/model_info")).json()["weight_version"] == "v2"
    assert (await http.post(url + "/update_weights_from_disk", json={})).status_code == 400

    resp = await http.post(url + "/update_weight_version", json={"new_version": "v9"})
    assert resp.status_code == 200 and resp.json()["success"] is True and resp.json()["new_version"] == "v9"
    assert (await http.get(url + "/get_model_info")).json()["weight_version"] == "v9"


async def test_update_waits_for_in_flight_requests_when_not_paused(start_engine, http, tmp_path):
    handle = await start_engine(per_token_latency_s=0.005)
    url = handle.url
    running = asyncio.create_task(generate(http, url, gen_body(60, rid="old")))
    await tokens_made(handle, "old", 2)
    update = asyncio.create_task(
        http.post(url + "/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "new"})
    )
    await wait_until(lambda: handle.server._updating, what="update to start")
    later = asyncio.create_task(generate(http, url, gen_body(3, rid="later")))  # waits behind the update
    out = (await asyncio.wait_for(running, 5)).json()
    assert out["meta_info"]["weight_version"] == "default" and len(out["output_ids"]) == 60
    assert (await asyncio.wait_for(update, 5)).json()["success"] is True
    assert (await asyncio.wait_for(later, 5)).json()["meta_info"]["weight_version"] == "new"


async def test_in_place_update_mid_request_reports_weight_version_ranges(start_engine, http, tmp_path):
    handle = await start_engine(per_token_latency_s=0.004)
    url = handle.url
    task = asyncio.create_task(generate(http, url, gen_body(50, rid="span")))
    await tokens_made(handle, "span", 5)
    await http.post(url + "/pause_generation", json={"mode": "in_place"})
    split = len(handle.server.states["span"].state.output_ids)
    update = {"model_path": str(tmp_path), "weight_version": "1"}
    # flush_cache defaults to true (io_struct.py:1993); the running batch is not empty after an in_place pause, so the
    # flush fails the call although the weights were loaded, and the version stays (weight_updater.py:119-133).
    resp = await http.post(url + "/update_weights_from_disk", json=update)
    assert resp.status_code == 400 and resp.json()["success"] is False
    assert "cache was not flushed" in resp.json()["message"] and handle.server.weight_version == "default"
    assert handle.server.cache_flushes == 0
    resp = await http.post(url + "/update_weights_from_disk", json={**update, "flush_cache": False})
    assert resp.json() | {"load_seconds": 0} == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to 1.",
        "num_paused_requests": 1,
        "load_seconds": 0,
    }
    await http.post(url + "/continue_generation")
    meta = (await asyncio.wait_for(task, 5)).json()["meta_info"]
    assert meta["weight_version"] == "1"
    assert meta["weight_versions"] == [
        {"version": "default", "start": 0, "end": split},
        {"version": "1", "start": split, "end": 50},
    ]


# --- cache, health, info ---


async def test_flush_cache_refuses_while_running(start_engine, http):
    handle = await start_engine(per_token_latency_s=0.005)
    url = handle.url
    for method in ("GET", "POST"):
        resp = await http.request(method, url + "/flush_cache")
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        assert resp.text.startswith("Cache flushed.")
    task = asyncio.create_task(generate(http, url, gen_body(500, rid="busy")))
    await tokens_made(handle, "busy")
    resp = await http.post(url + "/flush_cache")
    assert resp.status_code == 400 and resp.headers["content-type"].startswith("text/plain")
    await http.post(url + "/abort_request", json={"abort_all": True})
    await task


async def test_info_endpoints(engine, http):
    url = engine.url
    assert (await http.get(url + "/health")).status_code == 200
    assert (await http.get(url + "/health_generate")).status_code == 200
    for path in ("/model_info", "/get_model_info"):
        info = (await http.get(url + path)).json()
        assert (
            info.items()
            >= {
                "model_path": "synthetic",
                "tokenizer_path": "synthetic",
                "is_generation": True,
                "weight_version": "default",
            }.items()
        )
    for path in ("/server_info", "/get_server_info"):
        info = (await http.get(url + path)).json()
        assert isinstance(info["internal_states"], list) and info["internal_states"]
        assert info["version"] and info["model_path"] == "synthetic" and info["context_length"] == 32768
    models = (await http.get(url + "/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 32768
    assert models["data"][0]["id"] == "synthetic"
    await generate(http, url, gen_body(4))
    metrics = (await http.get(url + "/metrics")).text
    for name in (  # observability/metrics_collector.py:365-405, 574, 1856-1960 (0.5.23)
        "num_running_reqs",
        "num_queue_reqs",
        "num_paused_reqs",
        "token_usage",
        "gen_throughput",
        "cache_hit_rate",
        "prompt_tokens_total",
        "generation_tokens_total",
        "cached_tokens_total",
        "num_requests_total",
        "num_aborted_requests_total",
        "num_retracted_requests_total",
    ):
        assert f"sglang:{name}{{" in metrics, name
    assert "# TYPE sglang:num_running_reqs gauge" in metrics


# --- the process ---


async def test_python_m_engine_serves_and_stops_on_sigterm(engine_process, http):
    proc, url = await engine_process("--weight-version", "step-3", "--length-dist", "fixed:5")
    out = (await http.post(url + "/generate", json={"input_ids": PROMPT})).json()
    assert out["meta_info"]["weight_version"] == "step-3" and out["output_ids"][-1] == 2
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 10) == 0
