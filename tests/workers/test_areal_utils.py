"""The areal.utils names of rollq.workers.api: what AReaL's workflow files call, with AReaL's signatures."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from rollq.workers.api import (
    apply_chat_template,
    atrace_session_phase,
    import_from_string,
    logging,
    stats_tracker,
    trace_session,
    workflow_context,
)
from rollq.workers.context import EpisodeContext, WorkflowContext, episode_scope
from rollq.workers.metrics import _workflow_stats
from rollq.workers.resolver import Allowlist, ImportNotAllowed, enforcing
from tests import reward_fns
from tests.scripted import tiny_tokenizer


def test_import_from_string_goes_through_the_allowlist():
    with enforcing(Allowlist(patterns=("tests",))):
        assert import_from_string("tests.reward_fns.exact_match") is reward_fns.exact_match  # AReaL's dotted form
        with pytest.raises(ImportNotAllowed):
            import_from_string("os.system")
    with pytest.raises(ValueError, match="Invalid module path"):
        import_from_string("")


def test_apply_chat_template_gives_a_list_of_ids():
    ids = apply_chat_template(tiny_tokenizer(), [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)
    text = apply_chat_template(tiny_tokenizer(), [{"role": "user", "content": "hi"}], tokenize=False)
    assert isinstance(text, str) and "hi" in text


def test_get_logger_takes_areals_arguments():
    logger = logging.getLogger("RLVRWorkflow", "colored", level=20)
    assert logger.name == "rollq.workflow.RLVRWorkflow" and logger.level == 20


class _Stats(Collector):
    def __init__(self, context: WorkflowContext) -> None:
        self.context = context

    def collect(self):  # type: ignore[no-untyped-def]
        return _workflow_stats(self.context.stats)


async def test_stats_recorded_in_a_worker_reach_its_metrics():
    @trace_session("reward")
    async def reward() -> float:
        return 1.0

    async with WorkflowContext() as context:
        for is_eval, value in ((False, 1.0), (False, 0.0), (True, 0.5)):
            with episode_scope(EpisodeContext(is_eval=is_eval)):
                stats_tracker.get(workflow_context.stat_scope()).scalar(reward=value, num_turns=torch.tensor(2))
        tracker = stats_tracker.get("rollout")
        with tracker.scope("actor"):
            tracker.denominator(mask=torch.tensor([1, 0, 1], dtype=torch.bool))
            tracker.stat(denominator="mask", ratio=torch.tensor([0.5, 9.0, 1.5]))
        async with atrace_session_phase("generate"):
            await asyncio.sleep(0)
        await reward()
        assert tracker.export() == {"reward": 0.5, "num_turns": 2.0, "actor/ratio": 1.0}
        assert tracker.export() == {}  # reset by the export
        assert stats_tracker.get("eval-rollout").export(reset=False) == {"reward": 0.5, "num_turns": 2.0}
        assert set(stats_tracker.get("perf").export()) == {"generate_s", "reward_s"}
        registry = CollectorRegistry()
        registry.register(_Stats(context))
        text = generate_latest(registry).decode()
    assert 'rollq_workflow_stat_sum{key="reward",tracker="rollout"} 1.0' in text
    assert 'rollq_workflow_stat_count{key="reward",tracker="rollout"} 2.0' in text
    assert 'rollq_workflow_stat_sum{key="reward",tracker="eval-rollout"} 0.5' in text


def test_outside_a_worker_stats_are_kept_nowhere():
    stats_tracker.scalar(reward=1.0)  # the default tracker, as AReaL's module-level `scalar`
    assert stats_tracker.get("").export() == {}
    with pytest.raises(TypeError, match="numbers"):
        stats_tracker.get("x").scalar(reward="high")
