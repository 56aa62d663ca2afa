"""Where rollq's engine server is as strict as SGLang 0.5.23's control plane (and 0.5.5's, with `compat`): each test
names the SGLang file and line it follows (sglang 0.5.23 wheel, `sglang/srt/...`)."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.engine.test_server_conformance import PROMPT, gen_body, generate, still_pending, tokens_made
from tests.helpers import wait_until


def events(resp: httpx.Response) -> list:
    return [json.loads(e[6:]) if e != "data: [DONE]" else "[DONE]" for e in resp.text.strip().split("\n\n")]


async def test_streamed_errors_are_http_200_an_error_event_and_done(start_engine, http):
    # entrypoints/http_server.py:951-975: a ValueError of a streamed request is an event, not a 4xx.
    handle = await start_engine(context_length=64, per_token_latency_s=0.005)
    url = handle.url
    too_long = {"input_ids": list(range(3, 70)), "stream": True}
    resp = await generate(http, url, too_long)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    error, done = events(resp)
    assert done == "[DONE]"
    assert error == {
        "error": {
            "message": "The input (67 tokens) is longer than the model's context length (64 tokens).",
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
    }
    running = asyncio.create_task(generate(http, url, gen_body(50, rid="dup")))
    await tokens_made(handle, "dup")
    resp = await generate(http, url, gen_body(2, rid="dup", stream=True))
    assert resp.status_code == 200 and events(resp)[0]["error"]["message"] == "Duplicate request ID detected: dup"
    # Non-streamed, the same errors are 400s; a malformed body is a 400 before any stream starts.
    assert (await generate(http, url, {**too_long, "stream": False})).status_code == 400
    assert (await generate(http, url, {"input_ids": "x", "stream": True})).status_code == 400
    await http.post(url + "/abort_request", json={"rid": "dup"})
    await running


async def test_admin_api_key_guards_control_routes(start_engine, http):
    # utils/auth.py:76-150: health/ready/metrics open; ADMIN_OPTIONAL routes need the admin key when one is set (the
    # api key is then refused); other routes need the api key.
    handle = await start_engine(server={"api_key": "usr", "admin_api_key": "adm"})
    url = handle.url
    usr, adm = {"Authorization": "Bearer usr"}, {"Authorization": "Bearer adm"}
    assert (await http.post(url + "/generate", json=gen_body(2), headers=usr)).status_code == 200
    assert (await http.post(url + "/generate", json=gen_body(2), headers=adm)).status_code == 401
    for path in ("/pause_generation", "/continue_generation", "/abort_request", "/flush_cache"):
        assert (await http.post(url + path, json={}, headers=usr)).status_code == 401, path
        assert (await http.post(url + path, json={}, headers=adm)).status_code == 200, path
    resp = await http.post(url + "/update_weights_from_disk", json={"model_path": "/nope"}, headers=usr)
    assert resp.status_code == 401
    for path in ("/health", "/health_generate", "/ready", "/metrics"):
        assert (await http.get(url + path)).status_code == 200, path

    only_admin = await start_engine(server={"admin_api_key": "adm"})
    assert (await http.post(only_admin.url + "/generate", json=gen_body(2))).status_code == 200
    assert (await http.post(only_admin.url + "/pause_generation", json={})).status_code == 401
    assert (await http.post(only_admin.url + "/pause_generation", json={}, headers=adm)).status_code == 200


async def test_health_blocks_while_updating_then_503_and_recovers(start_engine, http, tmp_path):
    # The probe waits behind the model-update lock (tokenizer_manager.py:938-941) and the handler gives up after
    # SGLANG_HEALTH_CHECK_TIMEOUT (http_server.py:218, 779-799).
    handle = await start_engine(server={"health_timeout_s": 0.3}, load_delay_s=1.5)
    url = handle.url
    update = asyncio.create_task(http.post(url + "/update_weights_from_disk", json={"model_path": str(tmp_path)}))
    await wait_until(lambda: handle.server._updating > 0, what="the update to start")
    assert (await http.get(url + "/health_generate")).status_code == 503
    assert (await http.get(url + "/ready")).status_code == 200  # /ready looks at the pause only
    assert (await update).json()["success"] is True
    assert (await http.get(url + "/health_generate")).status_code == 200


async def test_health_answers_200_when_the_pause_ends_in_time(start_engine, http):
    handle = await start_engine(server={"health_timeout_s": 10.0})
    url = handle.url
    await http.post(url + "/pause_generation", json={"mode": "retract"})
    probe = asyncio.create_task(http.get(url + "/health_generate"))
    assert await still_pending(probe, 0.2)
    await http.post(url + "/continue_generation", json={})
    assert (await asyncio.wait_for(probe, 5)).status_code == 200


async def test_flush_cache_only_when_asked_and_never_over_a_running_batch(start_engine, http, tmp_path):
    # weight_updater.py:119-133 + scheduler.py:5518-5547: an update flushes only with flush_cache (default true), and
    # a flush needs an empty running batch (the waiting queue is ignored while paused).
    handle = await start_engine(per_token_latency_s=0.004)
    url, server = handle.url, handle.server
    update = {"model_path": str(tmp_path)}
    assert (await http.post(url + "/update_weights_from_disk", json=update)).json()["success"] is True
    assert server.cache_flushes == 1
    kept = await http.post(url + "/update_weights_from_disk", json={**update, "flush_cache": False})
    assert kept.status_code == 200
    assert server.cache_flushes == 1  # the KV of the old weights stays: rollq's client decides
    task = asyncio.create_task(generate(http, url, gen_body(300, rid="r")))
    await tokens_made(handle, "r")
    await http.post(url + "/pause_generation", json={"mode": "retract"})  # retract empties the running batch
    assert (await http.post(url + "/update_weights_from_disk", json=update)).json()["success"] is True
    assert server.cache_flushes == 2
    await http.post(url + "/continue_generation", json={})
    await tokens_made(handle, "r", len(server.states["r"].state.output_ids) + 1)
    await http.post(url + "/pause_generation", json={"mode": "in_place"})
    assert (await http.post(url + "/flush_cache")).status_code == 400
    assert server.cache_flushes == 2
    await http.post(url + "/continue_generation", json={})
    assert (await task).json()["meta_info"]["completion_tokens"] == 300
    assert (await http.post(url + "/flush_cache")).status_code == 200 and server.cache_flushes == 3


async def test_skip_tokenizer_init_refuses_stop_strings_and_min_new_tokens(start_engine, http):
    # sampling/sampling_params.py:440-467 (0.5.23 refuses; 0.5.5's scheduler crashes instead)
    handle = await start_engine(server={"skip_tokenizer_init": True})
    for params, message in (
        ({"stop": ["\n"]}, "stop=['\\n'] is unavailable when skip_tokenizer_init=True"),
        ({"min_new_tokens": 2}, "min_new_tokens=2 is unavailable when skip_tokenizer_init=True"),
    ):
        resp = await generate(http, handle.url, {"input_ids": PROMPT, "sampling_params": params})
        assert resp.status_code == 400 and resp.json()["error"]["message"].startswith(message)
    ok = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "stop_token_ids": [7], "min_new_tokens": 0}}
    assert (await generate(http, handle.url, ok)).status_code == 200


async def test_priority_is_a_top_level_integer(engine, http):
    # managers/io_struct.py:323 GenerateReqInput.priority
    resp = await generate(http, engine.url, gen_body(2, priority=5))
    assert resp.status_code == 200
    assert (await generate(http, engine.url, gen_body(2, priority="high"))).status_code == 400


async def test_compat_055_pause_always_aborts_and_streams_deltas(start_engine, http):
    # 0.5.5: /pause_generation takes no mode (every pause aborts and returns without draining); streamed output_ids
    # are deltas; the info routes are the old ones; retractions are `total_retractions`.
    handle = await start_engine(server={"compat": "0.5.5"}, per_token_latency_s=0.004)
    url = handle.url
    info = (await http.get(url + "/get_server_info")).json()
    assert info["version"] == "0.5.5"
    assert (await http.get(url + "/server_info")).status_code == 404
    assert (await http.get(url + "/model_info")).status_code == 404
    assert (await http.get(url + "/ready")).status_code == 404
    assert (await http.get(url + "/get_weight_version")).json() == {"weight_version": "default"}

    resp = await generate(http, url, gen_body(12, stream=True))
    chunks = [e for e in events(resp) if e != "[DONE]"]
    streamed = [t for c in chunks for t in c["output_ids"]]
    final = (await generate(http, url, gen_body(12))).json()
    assert streamed == final["output_ids"] and len(chunks) > 1
    assert "total_retractions" in final["meta_info"] and "num_retractions" not in final["meta_info"]

    task = asyncio.create_task(generate(http, url, gen_body(2000, rid="r")))
    await tokens_made(handle, "r", 2)
    assert (await http.post(url + "/pause_generation", json={"mode": "in_place"})).status_code == 200
    out = (await asyncio.wait_for(task, 5)).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and 2 <= len(out["output_ids"]) < 2000
    await http.post(url + "/continue_generation")
