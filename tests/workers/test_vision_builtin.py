"""rollq's own vision workflow (`vision_rlvr`) on the built-in visual task, through Redis, a worker and a real
engine server (scripted, on the tiny Qwen2-VL's tokenizer): the picture reaches the engine and the trajectory."""

from __future__ import annotations

import pytest

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.producer.producer import JobRequest
from rollq.protocol import Codec
from rollq.protocol.messages import VisionInputs
from rollq.tasks import colours
from tests.areal_real import submit_all
from tests.helpers import running_worker
from tests.scripted import scripted_engine

KWARGS = {"reward_fn": "rollq.tasks.colours:colours_reward", "processor": "tiny-vl", "max_new_tokens": 4}


@pytest.mark.parametrize("reply", ["A", "C"])
async def test_the_colours_task_through_a_worker(redis, redis_url, run_name, reply):
    data = colours.prompts(1)[0]  # a red picture: answer A
    async with scripted_engine([reply], tokenizer="tiny-vl") as engine:
        async with EnginePool(PoolConfig(urls=[engine.url])) as pool:
            async with running_worker(redis_url, run_name, engine=pool, max_attempts=1, allow=["rollq.tasks"]):
                got = await submit_all(
                    redis, run_name, [JobRequest(workflow="vision_rlvr", data=data, workflow_kwargs=KWARGS, job_id="c")]
                )
    [t] = got["c"]
    assert t.status == "ok", t.error
    [seq] = t.sequences
    assert seq.reward == (1.0 if reply == "A" else 0.0)
    vision = Codec().decode(seq.vision.inline, VisionInputs)
    assert list(vision.image_grid_thw) == [1, 4, 4] and sum(vision.mm_token_type_ids) == 4
    assert len(vision.mm_token_type_ids) == len(seq.input_ids)
