"""The engine pool and the fleet with LoRA adapters, against real synthetic engines: a request names its adapter
(`lora_path`) and each token gets that adapter's version; an engine that lacks it serves the newest adapter of the
same run instead (tokens stamped with that one); the fleet loads and unloads adapters without pausing anything."""

from __future__ import annotations

import json

import pytest

from rollq.engine.client import EngineError
from rollq.engine.fleet import FleetController
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.types import ModelRequest, SamplingParams

ADAPTER_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


def adapter_dir(root, name: str):
    directory = root / name
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps(ADAPTER_CONFIG))
    return directory


def request(lora: str | None) -> ModelRequest:
    return ModelRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=5, ignore_eos=True), lora_path=lora)


@pytest.fixture
async def lora_pool(start_engine, tmp_path):
    engine = await start_engine(server={"enable_lora": True, "weight_version": "0"})
    pool = EnginePool(PoolConfig(urls=[engine.url]))
    await pool.start()
    yield engine, pool, FleetController(pool)
    await pool.close()


async def test_tokens_carry_the_version_of_the_adapter_that_made_them(lora_pool, tmp_path):
    engine, pool, fleet = lora_pool
    for version in (3, 4):
        report = await fleet.load_adapter(f"run-v{version}", str(adapter_dir(tmp_path, f"a{version}")))
        assert report.updated == [engine.url] and report.pause.ok == [] and report.resume.ok == []
    again = await fleet.load_adapter("run-v4", str(tmp_path / "a4"))  # a retried load: already there, fine
    assert again.updated == [engine.url]
    assert (await pool.agenerate(request("run-v3"))).output_versions == [3] * 5
    assert (await pool.agenerate(request("run-v4"))).output_versions == [4] * 5
    assert (await pool.agenerate(request(None))).output_versions == [0] * 5  # the base model's weight_version
    calls = engine.server.control_calls
    assert calls["/load_lora_adapter"] == 3 and not calls["/pause_generation"] and not calls["/flush_cache"]


async def test_an_engine_without_the_named_adapter_serves_its_newest_of_that_run(lora_pool, tmp_path):
    engine, pool, fleet = lora_pool
    await fleet.load_adapter("run-v5", str(adapter_dir(tmp_path, "a5")))
    await fleet.load_adapter("other-v9", str(adapter_dir(tmp_path, "b9")))
    resp = await pool.agenerate(request("run-v2"))  # unloaded since (or an engine restarted meanwhile)
    assert resp.output_versions == [5] * 5  # not 9: another run's adapter never serves this one
    result = await fleet.unload_adapter("run-v5")
    assert result.ok == [engine.url] and "run-v5" not in engine.server.adapters
    assert (await fleet.unload_adapter("run-v5")).ok == [engine.url]  # gone already: nothing to do
    with pytest.raises(EngineError, match="not loaded: run-v2"):
        await pool.agenerate(request("run-v2"))  # no adapter of the run left: the request fails, saying why
