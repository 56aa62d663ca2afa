"""`weight_sync: distributed`: a short real training run whose weights reach the engine only by broadcast (no
directory shared with the engine), checked by reading the engine's parameters back."""

import io

import msgspec
import pytest

torch = pytest.importorskip("torch")

from rollq.engine.pool import EnginePool, PoolConfig  # noqa: E402
from rollq.engine.server.app import EngineServerConfig, serve  # noqa: E402
from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig  # noqa: E402
from rollq.trainer.loop import Trainer  # noqa: E402
from rollq.trainer.policy import Policy  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 2


# the tiny model: ~1.5 MiB. Buckets are CI's at 2 ranks (test_ranks_train: 0.25 MiB gathered from both ranks'
# shards); at 1 rank they run in the chaos loop.
@pytest.mark.parametrize(
    "bucket_mb", [512.0, pytest.param(0.25, marks=pytest.mark.scenario)], ids=["one-bucket", "buckets"]
)
async def test_a_run_with_distributed_weight_sync_needs_no_shared_directory(
    redis, redis_url, run_name, tmp_path, make_train_config, spawn_worker, bucket_mb
):
    engine = await serve(ReferenceBackend(ReferenceConfig(model="tiny", max_running=8)), EngineServerConfig(port=0))
    spawn_worker(redis_url, run_name, "--concurrency", "4", "--engine", engine.url)
    weights_dir = tmp_path / "weights"
    cfg = make_train_config(
        weights_dir=str(weights_dir),
        engine=[engine.url],
        steps=STEPS,
        group_size=2,
        groups_per_step=2,
        max_staleness=1,
        weight_sync="distributed",
        weight_sync_timeout_s=20.0,
        publish_bucket_mb=bucket_mb,
    )
    policy = Policy(cfg)
    pool = EnginePool(PoolConfig(urls=[engine.url]))
    try:
        trainer = Trainer(cfg, redis, pool, progress=io.StringIO(), policy=policy)
        records = msgspec.to_builtins(await trainer.run())
        assert [r["version"] for r in records] == list(range(1, STEPS + 1))
        assert not weights_dir.exists()  # nothing was written for the engine to read
        assert engine.server.weight_version == str(STEPS)
        served = dict(engine.server.backend.model.named_parameters())
        for name, p in policy.model.named_parameters():
            assert torch.equal(served[name], p.detach()), name
        assert all(r["weight_load_s"] > 0 for r in records)
        # a full update pauses the engine: the pause lies within the publish (which also holds the broadcast)
        assert all(0 < r["pause_s"] <= r["publish_s"] for r in records), [
            (r["pause_s"], r["publish_s"]) for r in records
        ]
        # the publish is what came before the pause (gathering the weights) and the cycle
        assert all(r["prepare_s"] > 0 for r in records)
        assert all(r["publish_s"] == pytest.approx(r["prepare_s"] + r["pause_s"]) for r in records), [
            (r["prepare_s"], r["pause_s"], r["publish_s"]) for r in records
        ]
    finally:
        await pool.close()
        await engine.close()
