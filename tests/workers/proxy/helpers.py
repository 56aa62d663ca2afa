"""A recording proxy in front of a scripted synthetic engine, reached through the real EnginePool (the `stack`
fixtures in conftest.py start one per test)."""

from __future__ import annotations

from contextlib import asynccontextmanager

import msgspec

from rollq.engine.client import parse_generate
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.workers.context import ContextConfig, WorkflowContext
from rollq.workers.proxy.server import ProxyConfig, RecordingProxy
from tests.agents import SCRIPT
from tests.scripted import scripted_engine


class Stack(msgspec.Struct):
    proxy: RecordingProxy
    context: WorkflowContext
    engine_url: str

    def openai(self, key: str):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.proxy.base_url, api_key=key, http_client=self.context.http_client())

    async def direct(
        self, prompt_ids: list[int], max_new_tokens: int, image_data: list[str] | None = None
    ) -> tuple[list[int], list[float]]:
        """The same prompt (and images) sent straight to the engine: what the engine returns for it."""
        body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": max_new_tokens}, "return_logprob": True}
        if image_data:
            body["image_data"] = image_data
        resp = await self.context.http_client().post(f"{self.engine_url}/generate", json=body)
        result = parse_generate(resp.json())
        return result.output_ids, result.output_logprobs


@asynccontextmanager
async def make_stack(script: list[str] = SCRIPT, proxy: ProxyConfig | None = None, **engine_config):
    """`engine_config` goes to the scripted engine; its `tokenizer` (default "tiny") is the proxy's too."""
    engine_config.setdefault("tokenizer", "tiny")
    config = ContextConfig(tokenizer=engine_config["tokenizer"], proxy=proxy or ProxyConfig())
    async with scripted_engine(script, **engine_config) as engine, EnginePool(PoolConfig(urls=[engine.url])) as pool:
        async with WorkflowContext(config) as ctx:
            proxy = await ctx.proxy(pool)
            yield Stack(proxy=proxy, context=ctx, engine_url=engine.url)
