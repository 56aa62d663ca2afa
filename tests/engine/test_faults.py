"""`rollq engine --fault` (engine/server/faults.py): generation fails as a model forward that raises does in the
reference engine, an ERROR traceback and an engine-error abort, only for the states the fault hits; everything else
is the wrapped backend's. A real synthetic backend; no mocks."""

from __future__ import annotations

import logging

import pytest

from rollq.engine.server.backend import GenState
from rollq.engine.server.commands import engine
from rollq.engine.server.config import EngineConfig
from rollq.engine.server.faults import FaultyBackend, LoadHold, StepFault, parse_fault
from rollq.engine.server.synthetic import SyntheticBackend
from rollq.engine.types import FinishReason, SamplingParams


def test_the_fault_spec_is_parsed_and_a_bad_one_refused_before_anything_starts(capsys):
    assert StepFault.parse("step_error") == StepFault() and StepFault.parse("step_error:2") == StepFault(
        min_prompt_tokens=2
    )
    for bad in ("step_errors", "step_error:x", "step_error:-1", "", "hold_load:/tmp/h"):
        with pytest.raises(ValueError, match="bad fault"):
            StepFault.parse(bad)
    assert parse_fault("hold_load:/tmp/h") == LoadHold(directory="/tmp/h")
    with pytest.raises(ValueError, match="bad fault"):
        parse_fault("hold_load:")
    assert engine(EngineConfig(backend="synthetic", fault="boom")) == 2
    usage = "rollq engine: bad fault 'boom': use step_error, step_error:MIN_PROMPT_TOKENS or hold_load:DIR"
    assert usage in capsys.readouterr().err
    assert engine(EngineConfig(backend="sglang", model="/m", fault="step_error")) == 2
    assert "--fault needs the synthetic or reference backend" in capsys.readouterr().err


async def test_a_hit_state_fails_like_a_failed_step_and_the_others_generate(caplog):
    caplog.set_level(logging.ERROR, "rollq.engine")
    backend = FaultyBackend(SyntheticBackend(), StepFault(min_prompt_tokens=2))
    await backend.start()
    try:
        long, short = (GenState(rid, ids, SamplingParams(max_new_tokens=4)) for rid, ids in (("a", [5, 6]), ("b", [5])))
        await backend.run(long)
        await backend.run(short)
    finally:
        await backend.close()
    assert long.finish == FinishReason(
        type="abort",
        message="engine error: InjectedStepError('injected step failure (fault step_error:2)')",
        status_code=500,
        err_type="InjectedStepError",
    )
    assert long.output_ids == [] and long.first_token_at is None  # before its first token, as a failed prefill
    assert short.finish is not None and short.finish.type in ("stop", "length") and short.output_ids
    [record] = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert record.getMessage() == "engine step failed; aborting the running batch"
    assert backend.failed_steps == 1 and backend.vocab_size == SyntheticBackend().vocab_size
