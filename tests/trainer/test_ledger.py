"""The staleness ledger in a real Redis: the admission bound, group units, restarts."""

import asyncio

from rollq.trainer.ledger import StalenessLedger


async def test_the_bound_is_exact_under_concurrent_admission(redis, run_name):
    ledger = StalenessLedger(redis, run_name, batch_samples=8, max_staleness=1)
    await ledger.reset()
    # 40 groups of 4 race for (eta + v + 1) * B = 16 samples at version 0: exactly 4 groups get in, whole.
    got = await asyncio.gather(*(ledger.admit(f"g{i}", 4) for i in range(40)))
    assert sum(a.admitted for a in got) == 4
    assert max(a.samples_admitted for a in got) == 16 and {a.limit for a in got} == {16}
    assert (await ledger.state()).admitted == 16
    # nothing is left, not even for a group of 1
    assert not (await ledger.admit("small", 1)).admitted
    await ledger.set_version(1)  # one version later: room for one more batch
    got = await asyncio.gather(*(ledger.admit(f"h{i}", 4) for i in range(40)))
    assert sum(a.admitted for a in got) == 2 and (await ledger.state()).admitted == 24


async def test_a_group_counts_once_and_gives_back_once(redis, run_name):
    ledger = StalenessLedger(redis, run_name, batch_samples=4, max_staleness=0)
    await ledger.reset()
    assert (await ledger.admit("g0", 4)).admitted
    again = await ledger.admit("g0", 4)  # a restarted trainer offering the same group
    assert again.admitted and again.samples_admitted == 4
    assert not (await ledger.admit("g1", 4)).admitted
    assert await ledger.release("g0") == 4
    assert await ledger.release("g0") == 0  # once
    assert (await ledger.state()).admitted == 0 and (await ledger.state()).released == 4
    assert (await ledger.admit("g1", 4)).admitted
    assert await ledger.release("never-admitted") == 0


async def test_versions_move_forward_and_a_restart_restores_its_own(redis, run_name):
    ledger = StalenessLedger(redis, run_name, batch_samples=4, max_staleness=2)
    await ledger.reset()
    assert await ledger.set_version(5) == 5
    assert await ledger.set_version(3) == 5  # never backwards ...
    assert not await ledger.restore(4, trained_samples=99)  # ... except to a checkpoint's version
    state = await ledger.state()
    assert (state.version, state.admitted) == (4, 0)


async def test_a_ledger_lost_with_redis_is_rebuilt_from_the_checkpoint(redis, run_name):
    ledger = StalenessLedger(redis, run_name, batch_samples=4, max_staleness=0)
    await ledger.reset()
    await ledger.admit("g0", 4)
    await redis.delete(ledger.keys.ledger, ledger.keys.ledger_groups)  # Redis restarted without persistence
    assert await ledger.restore(3, trained_samples=12)
    state = await ledger.state()
    assert (state.version, state.admitted) == (3, 12)
    assert (await ledger.admit("g0", 4)).admitted  # (0 + 3 + 1) * 4 = 16 >= 12 + 4
    assert not (await ledger.admit("g1", 4)).admitted


async def test_rollq_status_shows_the_ledger(redis, run_name):
    from rollq.producer.status import format_status, gather_status

    assert (await gather_status(redis, run_name)).trainer is None  # no trainer yet
    ledger = StalenessLedger(redis, run_name, batch_samples=8, max_staleness=2)
    await ledger.reset()
    await ledger.admit("g0", 8)
    await ledger.set_version(1)
    status = await gather_status(redis, run_name)
    assert (status.trainer.version, status.trainer.admitted, status.trainer.bound) == (1, 8, 32)
    assert "trainer: policy version 1; 8 samples admitted of at most 32, 0 given back" in format_status(status)


async def test_give_backs_are_counted_by_reason_with_the_give_back(redis, run_name):
    from rollq.producer.status import format_status, gather_status

    ledger = StalenessLedger(redis, run_name, batch_samples=4, max_staleness=1)
    await ledger.reset()
    for g in ("a", "b", "c"):
        assert (await ledger.admit(g, 2)).admitted
    await ledger.release("a", "stale")
    await ledger.release("a", "stale")  # once
    await ledger.release("b", "failed")
    state = await ledger.state()
    assert state.released == 4 and state.released_by_reason == {"stale": 2, "failed": 2}
    assert "given back by dropped groups (failed 2, stale 2)" in format_status(await gather_status(redis, run_name))
