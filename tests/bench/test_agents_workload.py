"""bench/agents.py part 3's workload is the same in every system: the synthetic engine's reply fillers are a function
of the prompt alone (and decode / re-encode to themselves), tool latencies a function of (episode, call)."""

from __future__ import annotations

import os

from bench.agent_tasks import CALL_WAIT, SCRIPT, tool_latency_s
from bench.agents import COMMAND_AGENT
from rollq.engine.server.synthetic import LengthDist, SyntheticBackend, SyntheticConfig


def _backend(**kwargs) -> SyntheticBackend:
    dist = LengthDist(kind="pareto", xmin=16, alpha=1.2)
    return SyntheticBackend(SyntheticConfig(tokenizer="tiny", replies=SCRIPT, filler=dist, **kwargs))


def _prompt(b: SyntheticBackend, question: str) -> list[int]:
    return b.encode(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def test_reply_filler_is_drawn_from_the_prompt_and_survives_decode_and_reencode():
    a, b = _backend(), _backend()
    call = a.encode(CALL_WAIT)
    sizes = set()
    for i in range(40):
        script, done = a._locate_reply(_prompt(a, f"q #{i}"), ignore_eos=False)
        assert done == 0 and script == b._locate_reply(_prompt(b, f"q #{i}"), ignore_eos=False)[0]
        assert script[-1] == a._eos and script[-1 - len(call) : -1] == call  # filler, the scripted reply, eos
        filler = script[: -1 - len(call)]
        sizes.add(len(filler))
        assert not set(filler) & (a.eos_token_ids | set(a._tok.all_special_ids) | set(call))
        assert a.encode(a.decode(filler)) == filler
        # a resubmitted prompt + partial output continues the same reply
        assert a._locate_reply(_prompt(a, f"q #{i}") + script[:7], ignore_eos=False) == (script, 7)
    assert len(sizes) > 5 and min(sizes) >= 16


def test_filler_is_capped():
    b = _backend(filler_max_tokens=20)
    call = b.encode(CALL_WAIT)
    assert all(len(b._locate_reply(_prompt(b, f"q{i}"), False)[0]) <= 20 + len(call) + 1 for i in range(50))


def test_tool_latency_is_a_function_of_episode_and_call():
    assert tool_latency_s(3, 1, 0.2, 1.0) == tool_latency_s(3, 1, 0.2, 1.0) != tool_latency_s(3, 2, 0.2, 1.0)
    draws = sorted(tool_latency_s(i, k, 0.2, 1.0) for i in range(200) for k in range(3))
    assert 0.15 < draws[len(draws) // 2] < 0.27  # median ~200 ms


def test_command_agent_is_executable():
    assert os.access(COMMAND_AGENT, os.X_OK)
