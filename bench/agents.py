"""Agent benchmarks: the recording proxy's per-request overhead, and agent-episode throughput of rollq vs a
synchronous batch loop (JSON summary as the last line).

    python -m bench.agents            # from the repo root
    python -m bench.agents --quick    # smoke run
    python -m bench.agents --skip 2   # part 1 only

Part 1 - proxy overhead. A synthetic engine (tiny ChatML tokenizer, zero latency, scripted replies of ~20 tokens) on
loopback, in this process. One request at a time, in interleaved rounds (every variant runs a block of
conversations per round, the order rotating, so drift hits all alike), each conversation 2 turns: the first request
(no parent) and the second, which continues the first (the proxy's parent-matching path: parent ids + only the new
turns' tokens). Variants:
  direct   SGLangClient.generate(prompt ids) to the engine's /generate (the ids the proxy sends, captured)
  pool     EnginePool.agenerate(ModelRequest) (what the proxy calls)
  aiohttp  a raw aiohttp POST to the proxy's /v1/chat/completions (the proxy's own cost, a fast client)
  sdk      openai.AsyncOpenAI chat.completions.create through the proxy with the worker's shared httpx client
           (what an agent pays: the proxy + the SDK's request building / response parsing + httpx)
The target (proxy overhead p50 <= 1.5 ms) is judged on p50(aiohttp) - p50(direct); sdk - direct is shown too.

Part 2 - agent workload. Episodes of 4 model turns (3 tool calls, then the answer; scripted replies) whose tool calls
each take 200 ms, on one synthetic engine with per-token latency (a decode step of the whole batch every few ms):
  A   rollq: redis-server, a `rollq worker` subprocess (concurrency C, the agent `bench.agent_tasks:WaitAgent` by
      import path, inline mode, openai.AsyncOpenAI over the shared httpx client, the worker's recording proxy),
      jobs submitted with Producer.submit_many; episodes/s from the first submit to the last trajectory read.
  B   naive synchronous RL loop: batches of C episodes; per turn, generate for the whole batch at once (concurrent
      EnginePool requests, token in / token out, no proxy), then run the batch's tools one after another
      (time.sleep(0.2) each), turn by turn.
  B'  the same loop with the batch's tools run concurrently (only the per-turn barriers remain).
  Diagnostic (not a target): A again with `bench.agent_tasks:RawWaitAgent`, the same loop over raw aiohttp, which
  separates the worker's own cost from the OpenAI SDK + shared httpx client's (--no-raw-agent skips it).
Targets: A/B >= 4.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/agents.py`: the repository root on sys.path)

import argparse
import asyncio
import contextlib
import itertools
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from bench.agent_tasks import ANSWER, CALL_WAIT, MODEL_TURNS, QUESTION, SCRIPT, TOOL_RESULT, WAIT_TOOL
from bench.common import (
    BenchError,
    Procs,
    delete_matching,
    print_summary,
    proc_cpu_s,
    run_bench,
    start_redis,
    start_worker,
)
from rollq.engine.client import SGLangClient
from rollq.engine.http import shared_http_session
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.server.app import EngineServerConfig, serve
from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig
from rollq.engine.types import ModelRequest, SamplingParams
from rollq.producer.producer import JobRequest, Producer
from rollq.protocol.keys import RunKeys
from rollq.protocol.messages import AgentOptions
from rollq.redis_client import redis_client
from rollq.workers.chat_template import continuation_ids, encode, render
from rollq.workers.context import ContextConfig, WorkflowContext

AGENT = "bench.agent_tasks:WaitAgent"
RAW_AGENT = "bench.agent_tasks:RawWaitAgent"  # diagnostic: the same loop over raw aiohttp instead of SDK + httpx
TARGET_PROXY_OVERHEAD_MS = 1.5
TARGET_A_VS_B = 4.0
VARIANTS = ("direct", "pool", "aiohttp", "sdk")
TURNS = ("first", "continuation")


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _ms(x: float) -> float:
    return round(1000 * x, 4)


# -- part 1: proxy overhead ----------------------------------------------------------------------------------------


class _Capture:
    """Stands in for the pool for one conversation, to capture the exact ModelRequests the proxy sends."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self.requests: list[ModelRequest] = []

    async def agenerate(self, req: ModelRequest, **kwargs: Any) -> Any:
        self.requests.append(req)
        return await self.pool.agenerate(req, **kwargs)


async def bench_proxy_overhead(conversations: int, rounds: int, warmup: int) -> dict[str, Any]:
    # Turn 1 answers a tool call, turn 2 (after the tool result) the final answer: the agent's path, tools included.
    replies = [CALL_WAIT, ANSWER]
    backend = SyntheticBackend(SyntheticConfig(tokenizer="tiny", replies=replies))
    engine = await serve(backend, EngineServerConfig(host="127.0.0.1", port=0))
    http = shared_http_session()
    client = SGLangClient(engine.url, http)
    pool = EnginePool(PoolConfig(urls=[engine.url]), http=http)
    raw_http = aiohttp.ClientSession()  # the aiohttp client of the proxy rows (its own connections)
    ctx = WorkflowContext(ContextConfig(tokenizer="tiny"))
    try:
        async with ctx:
            proxy = await ctx.proxy(pool)
            from openai import AsyncOpenAI

            sdk_http = ctx.http_client()  # what inline agents get
            url = proxy.base_url + "/chat/completions"
            first_messages = [{"role": "user", "content": QUESTION}]
            tools = [WAIT_TOOL]

            # One captured conversation: the exact requests (ids + sampling) the proxy sends for both turns.
            capture = _Capture(pool)
            proxy.engine = capture
            session = proxy.sessions.open()
            sdk = AsyncOpenAI(base_url=proxy.base_url, api_key=session.key, http_client=sdk_http, max_retries=0)
            r1 = await sdk.chat.completions.create(model="policy", messages=first_messages, tools=tools, max_tokens=64)
            m1 = r1.choices[0].message
            second_messages = [
                *first_messages,
                m1.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": m1.tool_calls[0].id, "content": TOOL_RESULT},
            ]
            r2 = await sdk.chat.completions.create(model="policy", messages=second_messages, tools=tools, max_tokens=64)
            proxy.sessions.close(session)
            proxy.engine = pool
            recs = session.ordered()
            if (
                len(recs) != 2
                or recs[0].parent is not None
                or recs[1].parent != recs[0].key
                or r2.choices[0].message.content != ANSWER
            ):
                raise BenchError("proxy: the second turn was not matched to the first as its parent")
            req1, req2 = capture.requests
            out_tokens = [len(recs[0].output_ids), len(recs[1].output_ids)]
            prompt_tokens = [len(req1.input_ids), len(req2.input_ids)]

            # -- the four variants: each runs one 2-turn conversation and returns the two latencies ------------------

            async def direct() -> tuple[float, float]:
                t0 = time.perf_counter()
                a = await client.generate(req1.input_ids, req1.sampling, return_logprob=True)
                t1 = time.perf_counter()
                b = await client.generate(req2.input_ids, req2.sampling, return_logprob=True)
                t2 = time.perf_counter()
                assert len(a.output_ids) == out_tokens[0] and len(b.output_ids) == out_tokens[1]
                return t1 - t0, t2 - t1

            async def pooled() -> tuple[float, float]:
                t0 = time.perf_counter()
                a = await pool.agenerate(
                    ModelRequest(input_ids=req1.input_ids, sampling=req1.sampling, affinity="bench")
                )
                t1 = time.perf_counter()
                b = await pool.agenerate(
                    ModelRequest(input_ids=req2.input_ids, sampling=req2.sampling, affinity="bench")
                )
                t2 = time.perf_counter()
                assert len(a.output_tokens) == out_tokens[0] and len(b.output_tokens) == out_tokens[1]
                return t1 - t0, t2 - t1

            # Every proxied conversation asks a new question (same length), so no tokenizer cache can serve the
            # user turn from an earlier conversation: only what a real run repeats (system prompt, tools) repeats.
            numbers = itertools.count(10_000)

            def fresh_question() -> list[dict[str, Any]]:
                return [{"role": "user", "content": f"{QUESTION} #{next(numbers)}"}]

            async def raw() -> tuple[float, float]:
                s = proxy.sessions.open()
                headers = {"Authorization": f"Bearer {s.key}"}
                first_messages = fresh_question()
                try:
                    body = {"model": "policy", "messages": first_messages, "tools": tools, "max_tokens": 64}
                    t0 = time.perf_counter()
                    async with raw_http.post(url, json=body, headers=headers) as resp:
                        one = await resp.json()
                    t1 = time.perf_counter()
                    msg = one["choices"][0]["message"]
                    body = {
                        "model": "policy",
                        "tools": tools,
                        "max_tokens": 64,
                        "messages": [
                            *first_messages,
                            msg,
                            {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": TOOL_RESULT},
                        ],
                    }
                    t2 = time.perf_counter()
                    async with raw_http.post(url, json=body, headers=headers) as resp:
                        two = await resp.json()
                    t3 = time.perf_counter()
                finally:
                    proxy.sessions.close(s)
                assert two["choices"][0]["message"]["content"] == ANSWER, two
                return t1 - t0, t3 - t2

            async def sdk_call() -> tuple[float, float]:
                s = proxy.sessions.open()
                first_messages = fresh_question()
                try:
                    c = AsyncOpenAI(base_url=proxy.base_url, api_key=s.key, http_client=sdk_http, max_retries=0)
                    t0 = time.perf_counter()
                    one = await c.chat.completions.create(
                        model="policy", messages=first_messages, tools=tools, max_tokens=64
                    )
                    t1 = time.perf_counter()
                    m = one.choices[0].message
                    msgs = [
                        *first_messages,
                        m.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": TOOL_RESULT},
                    ]
                    t2 = time.perf_counter()
                    two = await c.chat.completions.create(model="policy", messages=msgs, tools=tools, max_tokens=64)
                    t3 = time.perf_counter()
                finally:
                    proxy.sessions.close(s)
                assert two.choices[0].message.content == ANSWER
                return t1 - t0, t3 - t2

            calls = {"direct": direct, "pool": pooled, "aiohttp": raw, "sdk": sdk_call}
            for name in VARIANTS:  # warm-up: connections, code paths, caches
                for _ in range(warmup):
                    await calls[name]()
            lat: dict[str, dict[str, list[float]]] = {v: {t: [] for t in TURNS} for v in VARIANTS}
            per_round = max(1, conversations // rounds)
            t_start = time.perf_counter()
            for r in range(rounds):
                order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
                for name in order:
                    call, out = calls[name], lat[name]
                    for _ in range(per_round):
                        a, b = await call()
                        out["first"].append(a)
                        out["continuation"].append(b)
            seconds = time.perf_counter() - t_start
            breakdown = await _proxy_breakdown(proxy, raw_http, first_messages, tools, max(200, warmup * 5))
            if len(proxy.sessions):
                raise BenchError(f"proxy: {len(proxy.sessions)} sessions left open")
    finally:
        await raw_http.close()
        await pool.close()
        await http.close()
        await engine.close()

    rows: dict[str, dict[str, dict[str, float]]] = {}
    for name in VARIANTS:
        rows[name] = {
            t: {
                "p50_ms": _ms(statistics.median(lat[name][t])),
                "p90_ms": _ms(_pct(lat[name][t], 0.9)),
                "mean_ms": _ms(statistics.fmean(lat[name][t])),
            }
            for t in TURNS
        }
    overhead = {}
    for t in TURNS:
        d = rows["direct"][t]["p50_ms"]
        overhead[t] = {
            "proxy_vs_direct_ms": round(rows["aiohttp"][t]["p50_ms"] - d, 3),  # the proxy's own cost (judged)
            "proxy_vs_pool_ms": round(rows["aiohttp"][t]["p50_ms"] - rows["pool"][t]["p50_ms"], 3),
            "sdk_vs_direct_ms": round(rows["sdk"][t]["p50_ms"] - d, 3),  # what an OpenAI-SDK agent pays
            "sdk_vs_proxy_ms": round(rows["sdk"][t]["p50_ms"] - rows["aiohttp"][t]["p50_ms"], 3),  # SDK + httpx
            "pool_vs_direct_ms": round(rows["pool"][t]["p50_ms"] - d, 3),
        }
    return {
        "conversations_per_variant": per_round * rounds,
        "breakdown": breakdown,
        "rounds": rounds,
        "warmup": warmup,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "seconds": round(seconds, 2),
        "latency": rows,
        "overhead": overhead,
        "proxy_overhead_p50_ms": max(overhead[t]["proxy_vs_direct_ms"] for t in TURNS),
    }


async def _proxy_breakdown(
    proxy: Any, http: aiohttp.ClientSession, first_messages: list[dict[str, Any]], tools: list[dict[str, Any]], n: int
) -> dict[str, float]:
    """Where the proxy's time goes (p50s, ms): an empty HTTP round trip to it (GET /health: aiohttp client + server
    + loopback, the hop the proxy adds), and its prompt building for each turn (message/tool normalization, then
    the chat template + tokenizer for a new conversation, or parent match + continuation tokens for a later turn)."""
    from rollq.workers.proxy.chat import normalize_messages, normalize_tools

    hop = []
    for _ in range(n):
        t = time.perf_counter()
        async with http.get(proxy.root_url + "/health") as resp:
            await resp.read()
        hop.append(time.perf_counter() - t)
    s = proxy.sessions.open()
    try:
        async with http.post(
            proxy.base_url + "/chat/completions",
            headers={"Authorization": f"Bearer {s.key}"},
            json={"model": "policy", "messages": first_messages, "tools": tools, "max_tokens": 64},
        ) as resp:
            msg = (await resp.json())["choices"][0]["message"]
        second = [
            *first_messages,
            msg,
            {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": TOOL_RESULT},
        ]
        times: dict[str, list[float]] = {"first": [], "continuation": []}
        for _ in range(n):
            for turn, messages in (("first", first_messages), ("continuation", second)):
                t = time.perf_counter()
                prompt = proxy._chat_prompt(s, normalize_messages(messages), normalize_tools(tools))
                times[turn].append(time.perf_counter() - t)
                if (prompt.parent is None) != (turn == "first"):
                    raise BenchError(f"proxy breakdown: unexpected parent match for the {turn} turn")
    finally:
        proxy.sessions.close(s)
    return {
        "http_hop_p50_ms": _ms(statistics.median(hop)),
        "prompt_first_p50_ms": _ms(statistics.median(times["first"])),
        "prompt_continuation_p50_ms": _ms(statistics.median(times["continuation"])),
    }


# -- part 2: agent workload ----------------------------------------------------------------------------------------


def _check_trajectory(t: Any, tool_ids: list[int], answer_ids: list[int]) -> str | None:
    """None if the trajectory is an ok 4-turn episode (individual export: one sequence per completion, each the
    previous one extended, the last rewarded), else what is wrong."""
    if t.status != "ok":
        return f"status {t.status}: {t.error}"
    if len(t.sequences) != MODEL_TURNS:
        return f"{len(t.sequences)} sequences, expected {MODEL_TURNS}"
    prev: list[int] = []
    for k, seq in enumerate(t.sequences):
        ids, mask = list(seq.input_ids), list(seq.loss_mask)
        if ids[: len(prev)] != prev:
            return f"turn {k + 1} does not extend turn {k}"
        trained = [i for i, m in zip(ids, mask, strict=True) if m]
        want = answer_ids if k == MODEL_TURNS - 1 else tool_ids
        if trained[: len(want)] != want:
            return f"turn {k + 1}: trained tokens are not the scripted reply"
        prev = ids
    if t.sequences[-1].reward != 1.0:
        return f"final reward {t.sequences[-1].reward}"
    return None


async def bench_rollq_agents(
    url: str,
    procs: Procs,
    engine_url: str,
    episodes: int,
    concurrency: int,
    warmup: int,
    tool_s: float,
    timeout_s: float,
    tok: Any,
    agent: str = AGENT,
) -> dict[str, Any]:
    run = f"bench-agents-{uuid.uuid4().hex[:10]}"
    keys = RunKeys(run)
    redis = redis_client(url)
    tool_ids = tok.encode(CALL_WAIT, add_special_tokens=False)
    answer_ids = tok.encode(ANSWER, add_special_tokens=False)
    options = AgentOptions(mode="inline", export="individual", timeout_seconds=max(60.0, timeout_s))
    kwargs = {"tool_s": tool_s}
    worker = await start_worker(
        procs, redis, url, run, "--concurrency", str(concurrency), "--engine", engine_url, "--max-attempts", "1"
    )  # run_bench stops it on failure
    try:
        producer = Producer(redis, run)
        consumer = producer.consumer(group="trainer", name="bench")
        await consumer.setup()

        async def episodes_run(prefix: str, n: int) -> tuple[float, list[Any], dict[str, float | None]]:
            reqs = [
                JobRequest(
                    workflow=agent,
                    data={"question": f"{QUESTION} #{i}", "i": i},
                    job_id=f"{prefix}{i}",
                    workflow_kwargs=kwargs,
                    agent=options,
                )
                for i in range(n)
            ]
            got: dict[str, Any] = {}
            cpu0 = {"worker": proc_cpu_s(worker.pid), "bench_process": time.process_time()}
            t0 = time.perf_counter()
            submitted = await producer.submit_many(reqs)
            if len(submitted) != n or not all(s.admitted for s in submitted):
                raise BenchError("rollq: not every job was admitted")
            end = time.monotonic() + timeout_s
            while len(got) < n:
                left = end - time.monotonic()
                if left <= 0:
                    raise BenchError(f"rollq: only {len(got)} of {n} agent trajectories arrived in {timeout_s:g} s")
                if worker.poll() is not None:
                    raise BenchError(f"rollq worker died ({worker.returncode}):\n{procs.log_tail(worker)}")
                batch = await consumer.read(count=512, block_ms=max(1, min(500, int(left * 1000))))
                for d in batch:
                    if d.trajectory.job_id.startswith(prefix):
                        got[d.trajectory.job_id] = d.trajectory
                await consumer.commit(batch)
            elapsed = time.perf_counter() - t0
            cpu1 = {"worker": proc_cpu_s(worker.pid), "bench_process": time.process_time()}
            cpu = {k: (None if cpu0[k] is None or cpu1[k] is None else round(cpu1[k] - cpu0[k], 2)) for k in cpu0}
            return elapsed, list(got.values()), cpu

        if warmup:  # the worker's proxy starts (tokenizer load) and the agent class loads on the first episode
            _, trajs, _ = await episodes_run("warm", warmup)
            bad = [e for e in (_check_trajectory(t, tool_ids, answer_ids) for t in trajs) if e]
            if bad:
                raise BenchError(f"rollq warm-up: {len(bad)} bad trajectories, e.g. {bad[0]}")
        elapsed, trajs, cpu = await episodes_run("ep", episodes)
        bad = [e for e in (_check_trajectory(t, tool_ids, answer_ids) for t in trajs) if e]
        if bad:
            raise BenchError(f"rollq: {len(bad)} of {episodes} trajectories are not ok 4-turn episodes, e.g. {bad[0]}")
        durations = sorted(t.finished_at - t.started_at for t in trajs)
        return {
            "agent": agent,
            "episodes": episodes,
            "seconds": round(elapsed, 3),
            "episodes_per_s": round(episodes / elapsed, 2),
            "trajectories_ok": len(trajs),
            "episode_s_p50": round(statistics.median(durations), 3),
            "episode_s_max": round(durations[-1], 3),
            "cpu_s": cpu,
            # the worker's CPU per model request (agent SDK + httpx, proxy, pool client, Redis, export)
            "worker_cpu_ms_per_request": None
            if cpu["worker"] is None
            else round(1000 * cpu["worker"] / (episodes * MODEL_TURNS), 2),
        }
    finally:
        procs.stop(worker, grace_s=10)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(delete_matching(redis, f"{keys.prefix}:*"), 60)
        await redis.aclose()


async def bench_batch_loop(
    pool: EnginePool,
    tok: Any,
    episodes: int,
    batch_size: int,
    tool_s: float,
    concurrent_tools: bool,
    max_turns: int = 8,
) -> dict[str, Any]:
    """The naive loop: per batch, per turn, generate for every live episode at once, wait for all, then run the
    tools (sequentially: time.sleep; or concurrently), and go on with the next turn."""
    base = encode(
        tok, render(tok, [{"role": "user", "content": QUESTION}], tools=[WAIT_TOOL], add_generation_prompt=True)
    )
    sampling = SamplingParams(max_new_tokens=128)
    turns_done: list[int] = []
    rewards: list[float] = []
    gen_s = tool_wall_s = 0.0
    t0 = time.perf_counter()
    for start in range(0, episodes, batch_size):
        n = min(batch_size, episodes - start)
        prompts = {i: list(base) for i in range(n)}
        turns = dict.fromkeys(range(n), 0)
        live = list(range(n))
        for _ in range(max_turns):
            if not live:
                break
            tg = time.perf_counter()
            resps = await asyncio.gather(
                *(
                    pool.agenerate(ModelRequest(input_ids=prompts[i], sampling=sampling, affinity=f"b{start}-{i}"))
                    for i in live
                )
            )
            tt = time.perf_counter()
            gen_s += tt - tg
            calls = []
            for i, r in zip(live, resps, strict=True):
                turns[i] += 1
                text = tok.decode(r.output_tokens, skip_special_tokens=True)
                if "<tool_call>" in text:
                    calls.append(i)
                    prompts[i] = (
                        prompts[i]
                        + r.output_tokens
                        + continuation_ids(tok, r.output_tokens, [{"role": "tool", "content": TOOL_RESULT}])
                    )
                else:
                    rewards.append(1.0 if "42" in text else 0.0)
            if concurrent_tools:
                await asyncio.gather(*(asyncio.sleep(tool_s) for _ in calls))
            else:
                for _ in calls:
                    time.sleep(tool_s)  # a synchronous environment step (blocks, as naive code does)
            tool_wall_s += time.perf_counter() - tt
            live = calls
        turns_done += turns.values()
    elapsed = time.perf_counter() - t0
    if turns_done.count(MODEL_TURNS) != episodes or sum(rewards) != episodes:
        raise BenchError(
            f"batch loop: {episodes - turns_done.count(MODEL_TURNS)} episodes without {MODEL_TURNS} "
            f"turns, {episodes - sum(rewards):g} without the answer"
        )
    return {
        "episodes": episodes,
        "seconds": round(elapsed, 3),
        "episodes_per_s": round(episodes / elapsed, 2),
        "generate_s": round(gen_s, 3),
        "tools_s": round(tool_wall_s, 3),
    }


async def bench_agent_workload(url: str, procs: Procs, args: argparse.Namespace) -> dict[str, Any]:
    backend = SyntheticBackend(
        SyntheticConfig(
            tokenizer="tiny",
            replies=SCRIPT,
            per_token_latency_s=args.token_ms / 1000,
            per_request_latency_s=args.prefill_ms / 1000,
        )
    )
    tok = backend._tok
    engine = await serve(backend, EngineServerConfig(host="127.0.0.1", port=0))
    pool = EnginePool(PoolConfig(urls=[engine.url]))
    out: dict[str, Any] = {
        "episodes": args.episodes,
        "concurrency": args.concurrency,
        "tool_s": args.tool_s,
        "token_ms": args.token_ms,
        "prefill_ms": args.prefill_ms,
        "reply_tokens": [len(tok.encode(r, add_special_tokens=False)) + 1 for r in SCRIPT],
    }
    try:
        await pool.start()
        # warm the engine and the pool's connections
        await bench_batch_loop(pool, tok, min(8, args.concurrency), args.concurrency, 0.0, True)
        agents = {"A_rollq": AGENT} if args.no_raw_agent else {"A_rollq": AGENT, "A_rollq_raw_agent": RAW_AGENT}
        for name, agent in agents.items():
            out[name] = await bench_rollq_agents(
                url,
                procs,
                engine.url,
                args.episodes,
                args.concurrency,
                args.warmup_episodes,
                args.tool_s,
                args.timeout,
                tok,
                agent,
            )
        out["B_batch_sequential_tools"] = await bench_batch_loop(
            pool, tok, args.episodes, args.concurrency, args.tool_s, False
        )
        out["B2_batch_concurrent_tools"] = await bench_batch_loop(
            pool, tok, args.episodes, args.concurrency, args.tool_s, True
        )
    finally:
        await pool.close()
        await engine.close()
    a = out["A_rollq"]["episodes_per_s"]
    out["A_vs_B"] = round(a / out["B_batch_sequential_tools"]["episodes_per_s"], 2)
    out["A_vs_B2"] = round(a / out["B2_batch_concurrent_tools"]["episodes_per_s"], 2)
    # The floor an episode can't beat: 4 generations + 3 tool calls, no queueing.
    gen_turn_s = [(n * args.token_ms + args.prefill_ms) / 1000 for n in out["reply_tokens"]]
    out["episode_floor_s"] = round(sum(gen_turn_s) + 3 * args.tool_s, 3)
    out["ideal_episodes_per_s"] = round(args.concurrency / out["episode_floor_s"], 2)
    return out


# -- report --------------------------------------------------------------------------------------------------------


def print_report(summary: dict[str, Any]) -> None:
    p1 = summary.get("proxy_overhead")
    if p1:
        print(
            f"\nPart 1 - proxy overhead: one request at a time, {p1['conversations_per_variant']} two-turn "
            f"conversations per variant in {p1['rounds']} interleaved rounds (prompt {p1['prompt_tokens']} tokens, "
            f"output {p1['output_tokens']} tokens, zero-latency engine)"
        )
        print(f"  {'variant':<44} {'turn 1 p50':>10} {'p90':>8} {'turn 2 p50':>11} {'p90':>8}   (ms)")
        label = {
            "direct": "(a)  SGLangClient -> engine /generate",
            "pool": "(a') EnginePool.agenerate -> engine",
            "aiohttp": "(b') aiohttp POST -> proxy -> pool -> engine",
            "sdk": "(b)  AsyncOpenAI(httpx) -> proxy -> ... engine",
        }
        for v in VARIANTS:
            f, c = p1["latency"][v]["first"], p1["latency"][v]["continuation"]
            print(f"  {label[v]:<44} {f['p50_ms']:>10.3f} {f['p90_ms']:>8.3f} {c['p50_ms']:>11.3f} {c['p90_ms']:>8.3f}")
        o = p1["overhead"]
        print(
            f"  proxy's own overhead p50 (b' - a): turn 1 {o['first']['proxy_vs_direct_ms']:+.3f} ms, turn 2 "
            f"(parent match) {o['continuation']['proxy_vs_direct_ms']:+.3f} ms  -> target <= "
            f"{TARGET_PROXY_OVERHEAD_MS} ms: {'met' if summary['targets']['proxy_overhead_p50_ms<=1.5'] else 'NOT met'}"
        )
        print(
            f"  with the OpenAI SDK + httpx (b - a):   turn 1 {o['first']['sdk_vs_direct_ms']:+.3f} ms, turn 2 "
            f"{o['continuation']['sdk_vs_direct_ms']:+.3f} ms  (SDK + httpx alone, b - b': "
            f"{o['first']['sdk_vs_proxy_ms']:+.3f} / {o['continuation']['sdk_vs_proxy_ms']:+.3f} ms; pool vs bare "
            f"client: {o['first']['pool_vs_direct_ms']:+.3f} / {o['continuation']['pool_vs_direct_ms']:+.3f} ms)"
        )
        b = p1["breakdown"]
        print(
            f"  where the proxy's time goes (p50): an empty HTTP hop to it (GET /health) "
            f"{b['http_hop_p50_ms']:.3f} ms; "
            f"prompt building {b['prompt_first_p50_ms']:.3f} ms for turn 1 (chat template + tokenizer), "
            f"{b['prompt_continuation_p50_ms']:.3f} ms for turn 2 (parent match + continuation tokens)"
        )
    p2 = summary.get("agent_workload")
    if p2:
        print(
            f"\nPart 2 - agent episodes: {p2['episodes']} episodes each, concurrency / batch {p2['concurrency']}, "
            f"4 model turns (reply tokens {p2['reply_tokens']}, {p2['token_ms']:g} ms per decode step) + 3 tool "
            f"calls of {p2['tool_s'] * 1000:.0f} ms; episode floor {p2['episode_floor_s']:.3f} s "
            f"(ideal {p2['ideal_episodes_per_s']:.1f} episodes/s at this concurrency)"
        )
        print(f"  {'system':<58} {'episodes/s':>10} {'seconds':>8}")
        rows = [
            ("(A)  rollq: Producer -> Redis -> worker (proxy, OpenAI SDK)", p2["A_rollq"]),
            *(
                [("     (A) with a raw-aiohttp agent (diagnostic: no SDK/httpx)", p2["A_rollq_raw_agent"])]
                if "A_rollq_raw_agent" in p2
                else []
            ),
            ("(B)  batch loop, tools one after another", p2["B_batch_sequential_tools"]),
            ("(B') batch loop, tools concurrent (per-turn barriers)", p2["B2_batch_concurrent_tools"]),
        ]
        for name, r in rows:
            print(f"  {name:<58} {r['episodes_per_s']:>10.2f} {r['seconds']:>8.2f}")
        a = p2["A_rollq"]
        print(
            f"  A/B = {p2['A_vs_B']:.1f}x (target >= {TARGET_A_VS_B:g}x: "
            f"{'met' if summary['targets']['A_vs_B>=4'] else 'NOT met'}), A/B' = {p2['A_vs_B2']:.2f}x; rollq "
            f"episode p50 {a['episode_s_p50']:.3f} s (max {a['episode_s_max']:.3f}); all {a['trajectories_ok']} "
            f"trajectories ok with {MODEL_TURNS} turns"
        )
        print(
            f"  rollq CPU: worker {a['cpu_s']['worker']} s ({a['worker_cpu_ms_per_request']} ms per model request), "
            f"bench process (engine, producer, consumer) {a['cpu_s']['bench_process']} s"
        )
        raw = p2.get("A_rollq_raw_agent")
        if raw:
            print(
                f"  diagnostic: with the agent on raw aiohttp the same worker runs {raw['episodes_per_s']:.2f} "
                f"episodes/s at {raw['worker_cpu_ms_per_request']} ms worker CPU per request (episode p50 "
                f"{raw['episode_s_p50']:.3f} s): the rest is the OpenAI SDK + the shared httpx client"
            )


async def amain(args: argparse.Namespace, procs: Procs) -> dict[str, Any]:
    skip = set(filter(None, args.skip.split(",")))
    summary: dict[str, Any] = {"cpus": os.cpu_count()}
    targets: dict[str, bool] = {}
    if "1" not in skip:
        p1 = await bench_proxy_overhead(args.conversations, args.rounds, args.warmup)
        summary["proxy_overhead"] = p1
        targets["proxy_overhead_p50_ms<=1.5"] = p1["proxy_overhead_p50_ms"] <= TARGET_PROXY_OVERHEAD_MS
    if "2" not in skip:
        url = args.redis or start_redis(procs, procs.log_dir)
        p2 = await bench_agent_workload(url, procs, args)
        summary["agent_workload"] = p2
        targets["A_vs_B>=4"] = p2["A_vs_B"] >= TARGET_A_VS_B
    summary["targets"] = targets
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.agents", description=__doc__.split("\n\n")[0])
    p.add_argument("--redis", metavar="URL", help="use this Redis instead of starting a redis-server")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: 1,2")
    g = p.add_argument_group("part 1")
    g.add_argument(
        "--conversations", type=int, default=1500, help="2-turn conversations per variant (default 1500: 3000 requests)"
    )
    g.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default 10)")
    g.add_argument("--warmup", type=int, default=100, help="warm-up conversations per variant (default 100)")
    g = p.add_argument_group("part 2")
    g.add_argument("--episodes", type=int, default=128, help="episodes per system (default 128)")
    g.add_argument("--concurrency", type=int, default=64, help="worker concurrency = batch size (default 64)")
    g.add_argument("--tool-s", type=float, default=0.2, help="seconds per tool call (default 0.2)")
    g.add_argument("--token-ms", type=float, default=3.0, help="engine decode step, ms (default 3)")
    g.add_argument("--prefill-ms", type=float, default=0.0, help="engine per-request latency, ms (default 0)")
    g.add_argument("--warmup-episodes", type=int, default=8, help="rollq warm-up episodes (default 8)")
    g.add_argument("--no-raw-agent", action="store_true", help="skip the diagnostic rollq run with a raw aiohttp agent")
    g.add_argument("--timeout", type=float, default=120.0, help="seconds for rollq's episodes (default 120)")
    p.add_argument("--quick", action="store_true", help="smoke run: 300 conversations, 32 episodes at 16")
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.rounds, args.warmup = 300, 3, 30
        args.episodes, args.concurrency = 32, 16
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    async def run(procs: Procs, tmp: Path) -> None:
        summary = await amain(args, procs)
        print_report(summary)
        print_summary(summary)

    return run_bench(run, "rollq-bench-agents-")


if __name__ == "__main__":
    sys.exit(main())
