"""AReaL 1.0.4's `areal/experimental/workflow/multi_turn_v2.py` (a RolloutWorkflow on AReaL's in-process OpenAI
client, ArealOpenAI), copied from the real wheel with only its import lines changed to rollq.workers.api (mode (b),
tests/areal_real.py), in a rollq worker against a real EnginePool on a scripted engine, over real Redis streams."""

from __future__ import annotations

import uuid

import pytest

from tests.areal_real import areal_file, run_converted, user_package
from tests.scripted import tiny_tokenizer

FILE = "areal/experimental/workflow/multi_turn_v2.py"


def trained_text(seq) -> str:
    ids = [i for i, m in zip(seq.input_ids, seq.loss_mask, strict=True) if m]
    return tiny_tokenizer().decode(ids, skip_special_tokens=True)


@pytest.mark.slow  # reward processes start (~5 s)
async def test_multi_turn_v2_with_only_its_imports_changed(redis, redis_url, run_name, tmp_path, monkeypatch):
    """Wrong, reflection prompt, right: two completions, exported by `client.export_interactions()` (no style: AReaL
    1.0.4's own client requires one). The workflow discounts the final reward itself (0.9 after one wrong turn) and
    sets it on the last completion; the first keeps none (0), as in AReaL, which propagates nothing unless asked."""
    package = user_package(tmp_path, f"user_mtv2_{uuid.uuid4().hex[:8]}", {"multi_turn_v2": FILE})
    monkeypatch.syspath_prepend(str(tmp_path))
    original, converted = (
        areal_file(FILE).splitlines(),
        (tmp_path / package / "multi_turn_v2.py").read_text().splitlines(),
    )
    changed = [new for old, new in zip(original, converted, strict=True) if old != new]
    assert changed and all(line.startswith("from rollq.workers.api import ") for line in changed)

    # the kwargs as JSON, converted by the constructor's type hints and AReaL's `_fn` naming (workers/construct.py)
    kwargs = {
        "reward_fn": "tests.reward_fns:answer_in_completion",
        "gconfig": {"max_new_tokens": 32},
        "tokenizer": "tiny",
        "max_turns": 2,
        "turn_discount": 0.9,
    }
    replies = ["The answer is 4.", "The answer is 5."]
    [t] = await run_converted(
        redis, redis_url, run_name, replies, f"{package}.multi_turn_v2:MultiTurnWorkflow", workflow_kwargs=kwargs
    )
    assert t.status == "ok", t.error
    first, second = t.sequences
    assert (first.reward, second.reward) == (0.0, pytest.approx(0.9))
    assert trained_text(first) == "The answer is 4." and trained_text(second) == "The answer is 5."
    assert all(lp < 0 for seq in (first, second) for lp, m in zip(seq.logprobs, seq.loss_mask, strict=True) if m)
    # AReaL's default chat_template_type "hf": turn 2 is the whole conversation rendered again, turn 1's reply in it.
    prompt_2 = tiny_tokenizer().decode([i for i, m in zip(second.input_ids, second.loss_mask, strict=True) if not m])
    assert "The answer is 4." in prompt_2 and "Your answer is either wrong" in prompt_2
