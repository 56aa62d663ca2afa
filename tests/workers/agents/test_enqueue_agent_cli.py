"""The issue's done-when, as a user runs it: an engine process, a worker process started in the user's directory,
and `rollq enqueue prompts.jsonl --workflow my_module.MyAgent --n 2 --wait` with an OpenAI-SDK agent (multi-turn,
tools). The trajectories' tokens and logprobs must be exactly the engine's."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import httpx
import pytest

from rollq.engine.client import parse_generate
from rollq.local import free_port
from tests.agents import SCRIPT
from tests.helpers import engine_healthy, wait_registered, wait_until
from tests.scripted import tiny_tokenizer

AGENT = """
import json
from openai import AsyncOpenAI

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


class MyAgent:
    async def run(self, data, base_url, api_key, http_client):
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        messages = [{"role": "user", "content": data["question"]}]
        while True:
            resp = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD], max_tokens=64)
            msg = resp.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                return 1.0 if "5" in (msg.content or "") else 0.0
            for call in msg.tool_calls:
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
"""


@pytest.mark.slow
async def test_enqueue_wait_runs_an_openai_sdk_agent_token_exactly(tmp_path, redis, redis_url, run_name):
    (tmp_path / "my_module.py").write_text(textwrap.dedent(AGENT))
    (tmp_path / "replies.json").write_text(json.dumps(SCRIPT))
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"job_id": f"q{i}", "question": f"What is 2 + 3? ({i})"}) + "\n" for i in range(3))
    )
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    logs = [open(tmp_path / name, "w") for name in ("engine.log", "worker.log")]
    rollq = [sys.executable, "-m", "rollq"]
    procs = [
        subprocess.Popen(
            [
                *rollq,
                "engine",
                "--backend",
                "synthetic",
                "--tokenizer",
                "tiny",
                "--replies-file",
                "replies.json",
                "--port",
                str(port),
            ],
            cwd=tmp_path,
            stdout=logs[0],
            stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            [
                *rollq,
                "worker",
                "--redis",
                redis_url,
                "--run",
                run_name,
                "--name",
                "w-cli",
                "--allow",
                "my_module",
                "--module-path",
                str(tmp_path),
                "--engine",
                engine_url,
            ],
            cwd=tmp_path,
            stdout=logs[1],
            stderr=subprocess.STDOUT,
        ),
    ]
    try:
        await wait_until(lambda: engine_healthy(engine_url), 60, what="engine up")
        await wait_registered(redis, run_name, "w-cli")
        out = subprocess.run(
            [
                *rollq,
                "enqueue",
                "prompts.jsonl",
                "--workflow",
                "my_module.MyAgent",
                "--n",
                "2",
                "--wait",
                "--export-style",
                "concat",
                "--redis",
                redis_url,
                "--run",
                run_name,
                "--timeout",
                "90",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr + (tmp_path / "worker.log").read_text()
        assert "6 ok, 0 rejected, 0 errors" in out.stderr
        trajs = [json.loads(line) for line in out.stdout.splitlines()]
        assert sorted((t["job_id"], t["sample_index"]) for t in trajs) == [
            (f"q{i}", s) for i in range(3) for s in (0, 1)
        ]
        tok = tiny_tokenizer()
        async with httpx.AsyncClient(timeout=30) as http:
            for t in trajs:
                [seq] = t["sequences"]
                assert seq["reward"] == 1.0
                ids, mask, logprobs = seq["input_ids"], seq["loss_mask"], seq["logprobs"]
                # Each trained span is one model turn: replaying its prefix on the engine gives the same tokens and
                # logprobs (float32 on the wire).
                spans, start = [], None
                for i, m in enumerate([*mask, 0]):
                    if m and start is None:
                        start = i
                    elif not m and start is not None:
                        spans.append((start, i))
                        start = None
                assert len(spans) == 2
                for a, b in spans:
                    resp = await http.post(
                        f"{engine_url}/generate",
                        json={
                            "input_ids": ids[:a],
                            "sampling_params": {"max_new_tokens": b - a},
                            "return_logprob": True,
                        },
                    )
                    direct = parse_generate(resp.json())
                    assert direct.output_ids == ids[a:b]
                    assert [round(x, 5) for x in direct.output_logprobs] == [round(x, 5) for x in logprobs[a:b]]
                assert tok.decode(ids[spans[1][0] : spans[1][1]], skip_special_tokens=True) == SCRIPT[1]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        for f in logs:
            f.close()
