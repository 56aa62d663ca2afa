"""rollq behind SGLang's gateway, the real `smg` 1.13.0 on loopback in front of engines that joined it themselves
(`rollq engine --gateway-url`; synthetic ones: the pool's and the gateway's side is tested here, not a model; the
`rollq up --gateway smg` scenario runs reference engines): the pool recognises the gateway by its own `GET /workers`,
generates through it with each group's id as `X-SMG-Routing-Key` (a group's samples on one engine, read from the
engines' own request counters), and sends the fleet's control calls to each engine it lists (weight versions read
on each engine); an engine SIGKILLed mid-run loses no group; one that joins later is used; one that stops leaves the
gateway's list. sglang-router 0.3.2 keeps working where it did: generation through it, control to the engines it
lists."""

from __future__ import annotations

import asyncio
import signal

import pytest

from rollq.engine.fleet import FleetController
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.types import ModelRequest, SamplingParams
from rollq.local import Processes
from tests.gateways import (
    listed,
    requests_running,
    requests_served,
    start_sglang_router,
    start_smg,
    weight_version,
)
from tests.helpers import wait_until

ADMIN = "gateway-admin-key"  # the gateway's control-plane key (a test's own)
GROUP = 3  # samples per group


def group_requests(group: str, n: int = GROUP, max_new_tokens: int = 4) -> list[ModelRequest]:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return [ModelRequest(input_ids=[5, 6, 7, 8 + i], sampling=sampling, affinity=group) for i in range(n)]


async def counts(engines: list[str]) -> dict[str, int]:
    return {url: await requests_served(url) for url in engines}


async def joined_engines(engine_process, gateway: str, n: int) -> list[tuple]:
    """`n` synthetic engines started at once, each joining `gateway` itself (a decode step takes 20 ms, so a long
    request is still running when an engine is killed)."""
    args = ["--token-latency", "0.02", "--weight-version", "0"]
    args += ["--gateway-url", gateway, "--gateway-admin-api-key", ADMIN]
    return list(await asyncio.gather(*(engine_process(*args) for _ in range(n))))


async def busy(url: str) -> bool:
    return await requests_running(url) > 0


async def unlisted(gateway: str, url: str) -> bool:
    return url not in await listed(gateway, ADMIN)


async def listed_healthy(gateway: str, urls: list[str]) -> bool:
    workers = await listed(gateway, ADMIN)
    return all(u in workers and workers[u]["is_healthy"] for u in urls)


@pytest.mark.slow
async def test_pool_behind_smg_routes_groups_and_controls_every_engine(engine_process, tmp_path):
    procs = Processes(tmp_path / "gateway-logs")
    (tmp_path / "gateway-logs").mkdir()
    try:
        gateway = await start_smg(procs, admin_api_key=ADMIN, health_interval_s=1, health_failures=2)
        (e1, u1), (e2, u2) = await joined_engines(engine_process, gateway, 2)
        await wait_until(lambda: listed_healthy(gateway, [u1, u2]), 60, what="both engines joined the gateway")

        async with EnginePool(PoolConfig(urls=[gateway], gateway_admin_api_key=ADMIN)) as pool:
            # Recognised by its worker list: generation goes to the gateway, control calls to its two engines.
            assert pool.members[gateway].kind == "gateway"
            assert sorted(m.url for m in pool.engines()) == sorted([u1, u2])
            assert (await pool.facts(pool.members[gateway])).skip_tokenizer_init  # an engine's facts, not its own

            # A group's samples land on one engine (the routing key), and the groups spread over both. Between
            # sequential groups neither engine holds a key in flight, and smg's manual policy (min_group) then picks
            # at random: groups are sent one at a time until both engines own one, at most 40 (odds of 2^-39 that
            # a fair pick never reaches one of them).
            owner: dict[str, str] = {}
            for g in range(40):
                if len(set(owner.values())) == 2:
                    break
                before = await counts([u1, u2])
                outs = await asyncio.gather(*(pool.agenerate(r) for r in group_requests(f"grp-{g}")))
                assert all(len(o.output_tokens) == 4 for o in outs)
                after = await counts([u1, u2])
                served = {u: after[u] - before[u] for u in (u1, u2)}
                assert sorted(served.values()) == [0, GROUP], (g, served)  # all of the group on one engine
                owner[f"grp-{g}"] = max(served, key=served.__getitem__)
            assert set(owner.values()) == {u1, u2}, owner
            again = await counts([u1, u2])  # a group's later turn goes where the group went
            await asyncio.gather(*(pool.agenerate(r) for r in group_requests("grp-0")))
            assert (await requests_served(owner["grp-0"])) - again[owner["grp-0"]] == GROUP

            # A weight update reaches every engine behind the gateway (read on each engine).
            weights = tmp_path / "v1"
            weights.mkdir()
            (weights / "model.safetensors").write_bytes(b"")  # a synthetic engine takes any files
            fleet = FleetController(pool)
            report = await fleet.run_cycle(lambda: fleet.update_weights(str(weights), 1))
            assert sorted(report.updated) == sorted([u1, u2]), report.failures()
            assert [await weight_version(u) for u in (u1, u2)] == ["1", "1"]

            # SIGKILL one engine while groups generate through the gateway: every group completes, whole.
            groups = [group_requests(f"run-{g}", max_new_tokens=48) for g in range(8)]

            async def run_group(reqs: list[ModelRequest]):
                return await asyncio.gather(*(pool.agenerate(r) for r in reqs))

            running = [asyncio.create_task(run_group(g)) for g in groups]
            await wait_until(lambda: busy(u1), 60, what="requests in flight on the engine to kill")
            e1.send_signal(signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*running), 120)
            assert all(len(o.output_tokens) == 48 for outs in results for o in outs)
            assert sum(len(outs) == GROUP for outs in results) == len(groups)  # 0 groups lost

            # A new engine that joins the gateway is followed by the pool (control) and used (generation).
            ((e3, u3),) = await joined_engines(engine_process, gateway, 1)
            await wait_until(lambda: listed_healthy(gateway, [u3]), 60, what="the new engine joined the gateway")
            await pool.check_health()
            assert u3 in {m.url for m in pool.engines()}
            # New keys go to the engine holding the fewest routing keys in flight (smg's manual policy,
            # --assignment-mode min_group); between groups both hold none and smg picks at random. So new groups are
            # sent 4 at a time, a round at most 10 times: with the new engine in smg's routing at all, all of them
            # going elsewhere has odds of 2^-40.
            before = await requests_served(u3)
            for round_ in range(10):
                late = [group_requests(f"late-{round_}-{g}") for g in range(4)]
                await asyncio.gather(*(pool.agenerate(r) for reqs in late for r in reqs))
                if await requests_served(u3) - before >= GROUP:
                    break
            assert await requests_served(u3) - before >= GROUP  # the new engine took new groups

            # An engine that stops leaves the gateway (DELETE /workers/{id}), and then the pool.
            e3.send_signal(signal.SIGTERM)
            await asyncio.to_thread(e3.wait, 30)
            assert e3.returncode == 0
            # its DELETE answered 202 (removal queued): gone from the list soon after
            await wait_until(lambda: unlisted(gateway, u3), 10, what="the stopped engine left the gateway")
            await pool.check_health()
            assert u3 not in pool.members
    finally:
        procs.stop_all(grace_s=5)


@pytest.mark.slow
async def test_sglang_router_032_generation_through_it_control_to_its_engines(engine_process, tmp_path):
    procs = Processes(tmp_path / "router-logs")
    (tmp_path / "router-logs").mkdir()
    try:
        (_, u1), (_, u2) = await asyncio.gather(engine_process(), engine_process())  # synthetic engines
        _, router = await start_sglang_router(procs, [u1, u2])
        await wait_until(lambda: all_listed(router, [u1, u2]), 60, what="the router lists both engines")
        async with EnginePool(PoolConfig(urls=[router])) as pool:
            assert pool.members[router].kind == "gateway"  # its /workers, not its own /get_server_info
            assert sorted(m.url for m in pool.engines()) == sorted([u1, u2])
            before = await counts([u1, u2])
            outs = await asyncio.gather(*(pool.agenerate(r) for g in range(4) for r in group_requests(f"g{g}")))
            assert all(len(o.output_tokens) == 4 for o in outs)
            after = await counts([u1, u2])
            assert sum(after.values()) - sum(before.values()) == 4 * GROUP  # served by its engines
            fleet = FleetController(pool)
            report = await fleet.run_cycle(lambda: fleet.update_weights(str(tmp_path), 3))
            assert sorted(report.updated) == sorted([u1, u2]), report.failures()
            assert [await weight_version(u) for u in (u1, u2)] == ["3", "3"]
        # Its list is open (no admin key: anyone reaching it may POST /workers a URL of theirs). A pool holding engine
        # keys would send them to whatever it lists: it neither follows nor uses such a gateway, and says why.
        async with EnginePool(PoolConfig(urls=[router], api_key="engine-key")) as pool:
            assert pool.members[router].kind == "refused"
            assert pool.engines() == [] and not pool.members[router].routable
    finally:
        procs.stop_all(grace_s=5)


async def all_listed(router: str, urls: list[str]) -> bool:
    workers = await listed(router)
    return all(u in workers for u in urls)
