"""The training loop: feed the queue through the staleness ledger, consume fresh groups, train, move every engine
to the new weights, checkpoint.

One step, policy version v -> v + 1:
  collect B samples of complete groups fit to train at v -> decoupled PPO step -> pause engines, new weights
  (version v + 1) onto them: written to a shared directory and loaded (update_weights_from_disk), or broadcast
  (weight_sync distributed, rollq.engine.weight_group) -> resume (generation restarts here; a cycle that updated
  fewer engines than min_engines_updated is retried, then ends the run: trainer/publish.py) -> metrics line ->
  checkpoint -> ack what the checkpoint holds -> publish v + 1 in the ledger (new admissions).
A trainer killed anywhere restarts from its checkpoint: groups it trained and checkpointed are acked without
training, everything else is redelivered. With checkpoint_every 1 the ledger never runs ahead of the checkpoint,
so the admission bound holds across the restart; tokens of weights the checkpoint doesn't know (published before a
crash, never checkpointed) are dropped at consumption.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TextIO, TypeVar

import msgspec
import redis.asyncio as aioredis
import torch

from rollq.engine.client import EngineError, EngineUnavailable
from rollq.engine.fleet import FleetController, FleetResult, LoadResult
from rollq.engine.models import model_dir
from rollq.engine.pool import EngineMember, EnginePool
from rollq.engine.weight_group import DistributedSyncConfig, DistributedWeightSync, SyncResult
from rollq.producer.producer import Producer
from rollq.producer.results import Delivered, PartitionedConsumer, ResultConsumer
from rollq.protocol.keys import RunKeys, partition_of
from rollq.redis_client import ClusterView, ReplicaWait, ride_out
from rollq.tracing import Tracing, sample_attributes
from rollq.trainer import checkpoint
from rollq.trainer.batch import Batch, Group, build_batch, trained_versions
from rollq.trainer.checkpoint import TrainerState
from rollq.trainer.collector import Collected, GroupCollector
from rollq.trainer.config import TrainConfig
from rollq.trainer.data import PromptOrder, run_prompts
from rollq.trainer.delta_sync import DeltaSync, Update
from rollq.trainer.evaluate import Evaluator
from rollq.trainer.feeder import GroupFeeder, adapter_name
from rollq.trainer.ledger import StalenessLedger
from rollq.trainer.metrics import PLOT_FILE, MetricsLog, RateWindow, StepRecord, plot, update_fields
from rollq.trainer.policy import Policy, buckets_of
from rollq.trainer.policy_protocol import TrainerPolicy
from rollq.trainer.publish import UpdateRequirement, publish
from rollq.trainer.recovery import recover, repair_ledger
from rollq.trainer.samples import SampleLog

log = logging.getLogger("rollq.trainer")
T = TypeVar("T")

CONSUMER_GROUP = "trainer"
CONSUMER_NAME = "trainer"  # fixed: a restarted trainer first re-reads what its previous life left pending
UNLOAD_WAIT_S = 10.0  # at the end of a LoRA run, how long old adapters' unloads may take to finish
KEEP_WEIGHT_VERSIONS = 2  # an engine being reconciled may still read the previous version
PLOT_EVERY_STEPS = 20  # plot.png follows a long run
RATE_WINDOW_S = 10.0  # throughput figures average over at least this long (reads come in bursts)


def trained_tokenizer(policy: TrainerPolicy, model: str) -> Any:
    """The trained model's tokenizer: the policy's own, or (a policy without one: the seam's) the model's."""
    tokenizer = getattr(policy, "tokenizer", None)
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir(model))


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        redis: aioredis.Redis,
        pool: EnginePool,
        *,
        progress: TextIO | None = None,
        policy: TrainerPolicy | None = None,
        fresh_redis: bool = False,
        prompts: list[dict[str, Any]] | None = None,
        eval_prompts: list[dict[str, Any]] | None = None,
    ) -> None:
        """`fresh_redis`: Redis was started for this trainer life (`rollq up`'s private one), so a resumed run finding
        no ledger there is expected, not data Redis lost. `prompts` / `eval_prompts`: `dataset` / `eval_dataset`
        loaded already (`rollq up` checks them before it starts anything)."""
        self.cfg = config
        self.fresh_redis = fresh_redis
        self.redis = redis
        self.pool = pool
        self.fleet = FleetController(pool)
        self.update_requirement = UpdateRequirement(
            min_engines=config.min_engines_updated,
            retries=config.weight_update_retries,
            backoff_s=config.weight_update_backoff_s,
        )
        self.weight_sync: DistributedWeightSync | None = None
        if config.weight_sync == "distributed":
            self.weight_sync = DistributedWeightSync(
                pool,
                DistributedSyncConfig(
                    master_address=config.weight_sync_address,
                    master_port=config.weight_sync_port,
                    timeout_s=config.weight_sync_timeout_s,
                ),
            )
        self.run_dir = Path(config.directory)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.weights_root = Path(config.weights_root)
        # Full-weight updates send what changed since the version each engine holds (trainer/delta_sync.py); a LoRA
        # run serving adapters sends adapters
        serves_adapters = config.lora and config.lora_publish == "adapter"
        self.delta = DeltaSync(config, pool, self.weights_root) if config.delta_sync and not serves_adapters else None
        self.metrics = MetricsLog(self.run_dir, progress)
        # On a Redis Cluster the ledger's writes and the acks of trained samples wait for a replica (WAIT), so a
        # failover keeps them; what one loses anyway is written again (_recover).
        self.replica_wait = ReplicaWait(redis, config.redis_wait_replicas, config.redis_wait_timeout_ms)
        self.ledger = StalenessLedger(
            redis, config.run, config.batch_samples, config.max_staleness, wait=self.replica_wait
        )
        # A failover the cluster client followed by itself (no call failed) calls for the same recovery (_recover).
        self.cluster_view = ClusterView(redis, [self.ledger.keys.ledger])
        # Spans: each prompt's submit, each sample's train or drop (rollq/tracing.py); shut down as the run ends.
        self.tracing = Tracing.from_settings(config, "trainer")
        self.producer = Producer(redis, config.run, partitions=config.partitions, tracing=self.tracing)
        # One stream per partition on a partitioned run: replaced once the run's partition count is known (_run).
        self.consumer: ResultConsumer | PartitionedConsumer = ResultConsumer(
            redis, self.producer.reply_to, group=CONSUMER_GROUP, name=CONSUMER_NAME
        )
        if prompts is None:  # `rollq up` hands them over, loaded before anything started
            prompts, eval_prompts = run_prompts(config)
        self.prompts = PromptOrder(prompts, seed=config.seed)
        self.evaluator = Evaluator.for_run(redis, config, eval_prompts) if config.eval_dataset else None
        self.policy: TrainerPolicy = policy or Policy(config)
        self.samples = SampleLog(
            self.run_dir,
            every=config.samples_every,
            per_step=config.samples_per_step,
            tokenizer=functools.partial(trained_tokenizer, self.policy, config.model),
            out=self.metrics.out,
        )
        self.state = TrainerState(run_id=uuid.uuid4().hex[:8], model=config.model)
        self._unacked: list[Delivered] = []
        self._unacked_parts: list[tuple[str, int]] = []  # samples of parts of groups (split_groups) among them
        self._started = 0.0
        self._elapsed_before = 0.0  # a resumed run's elapsed_s at its checkpoint: elapsed_s goes on from there
        self.feeder: GroupFeeder | None = None
        self.collector: GroupCollector | None = None
        self._train_estimate_s = 0.0  # min_step_s: the last step's train time (pacing waits the rest up front)
        # A LoRA run serving versioned adapters (lora_publish adapter): the versions the engines hold, and the
        # unloads of older ones under way (each returns once that version's requests in flight have finished).
        self.adapter_family = config.run if config.lora and config.lora_publish == "adapter" else ""
        self._adapters_loaded: list[int] = []
        self._unloads: set[asyncio.Task[None]] = set()
        self._resumed = False  # from here on, a Redis that lost the ledger gets it back from self.state
        # Called once each step is done (checkpointed, acked, its version in the ledger): the seam's publish()
        # returns there (trainer/seam.py).
        self.step_done: list[Callable[[], None]] = []

    async def ride(self, op: Callable[[], Awaitable[T]], what: str) -> T:
        """A Redis call that rides out an outage of up to `redis_outage_s` (then RedisUnavailable ends the run)."""
        return await ride_out(
            op,
            what=what,
            limit_s=self.cfg.redis_outage_s,
            url=self.cfg.redis_url,
            recover=self._recover,
            moved=self.cluster_view.moved,
        )

    async def _recover(self) -> None:
        """Redis answered again after an outage: re-create what it may have lost (the results group, the ledger),
        write again the ledger writes it lost (a failover's or an AOF everysec restart's last writes) and re-read
        this consumer's pending entries (trainer/recovery.py)."""
        state = self.state if self._resumed else None
        await recover(
            self.consumer, self.producer, self.ledger, state=state, feeder=self.feeder, collector=self.collector
        )

    # -- start ---------------------------------------------------------------------------------------------------------

    async def _resume(self) -> bool:
        """The latest checkpoint (written by any number of ranks) into the policy (on however many it runs now)."""
        saved = await asyncio.to_thread(checkpoint.load, self.run_dir, self.policy)
        if saved is None and (self.run_dir / checkpoint.LEGACY_FILE).exists():
            # Starting over here would reset the run's ledger and train its groups again
            raise ValueError(
                f"{self.run_dir} holds a {checkpoint.LEGACY_FILE} of an older rollq (one file; checkpoints are now "
                f"sharded in {checkpoint.CHECKPOINTS}/): finish that run with the rollq that wrote it, or start "
                "this one in another run_dir"
            )
        if saved is None:
            await self.ride(self.ledger.reset, "resetting the ledger")
            self.metrics.truncate(0)
            return False
        if saved.ranks != self.policy.ranks.world_size:
            log.info("checkpoint of %d ranks resumed on %d", saved.ranks, self.policy.ranks.world_size)
        self.state = state = saved
        if await self.ride(lambda: self.ledger.restore(state.version, state.trained_samples), "restoring the ledger"):
            if self.fresh_redis:  # `rollq up`'s own Redis, new this life: nothing was lost
                log.info("the staleness ledger rebuilt from the checkpoint in this fresh Redis (as expected)")
            else:
                log.warning("the staleness ledger was gone from Redis; rebuilt from the checkpoint")
        self.metrics.truncate(self.state.step)
        done = self.metrics.read()
        self._elapsed_before = done[-1].elapsed_s if done else 0.0
        return True

    @property
    def trained_log_path(self) -> Path:
        return self.run_dir / "trained.jsonl"

    def _log_trained(self, step: int, version: int, groups: list[Group], min_version: int | None) -> None:
        """trained_log: one line per trained sample (append-only; `_cut_trained_log` undoes uncheckpointed steps);
        `oldest` is the oldest version among the tokens the loss trained (masked ones left out)."""
        lines = []
        floor = -1 if min_version is None else min_version
        for g in groups:
            for t in g.samples:
                span = [int(v) for s in t.sequences for v in trained_versions(s) if v >= floor]
                row = {"step": step, "version": version, "job_id": t.job_id, "sample_index": t.sample_index}
                lines.append(msgspec.json.encode({**row, "oldest": min(span, default=None)}) + b"\n")
        with self.trained_log_path.open("ab") as f:
            f.write(b"".join(lines))

    def _cut_trained_log(self, last_step: int) -> None:
        """Keep the samples of steps up to `last_step` (those the checkpoint holds)."""
        path = self.trained_log_path
        if not path.exists():
            return
        kept = []
        for ln in path.read_bytes().splitlines(keepends=True):
            try:
                if msgspec.json.decode(ln)["step"] <= last_step:
                    kept.append(ln)
            except msgspec.DecodeError:  # the torn tail of a write the crash interrupted
                pass
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(kept))
        os.replace(tmp, path)

    async def _publish_weights(self, version: int) -> dict[str, float]:
        """Weights of `version` onto the engines: pause, load, resume (generation resumes right after the load), on at
        least `min_engines_updated` of them (default: every healthy one), the cycle retried with backoff until it is;
        else WeightUpdateFailed ends the run (trainer/publish.py). Returns the phases of the cycle that made it, with
        what was sent (prepare_s, bytes_sent, bytes_per_engine, delta, full_engines, delta_share)."""
        if self.adapter_family:
            return await self._publish_adapter(version)
        if self.delta is not None:
            return await self._publish_delta(self.delta, version)
        started = time.monotonic()
        full_bytes = 0
        if self.weight_sync is not None:
            update = self._broadcast(self.weight_sync, version)
        else:
            path = await asyncio.to_thread(self.policy.save_weights, self.weights_root / f"v{version}")
            full_bytes = await asyncio.to_thread(safetensors_bytes, Path(path))
            await self.fleet.reconcile()  # engines that missed an update (or joined since) first catch up
            update = functools.partial(self.fleet.update_weights, str(path), version)
        prepare_s = time.monotonic() - started
        mode, requirement = self.cfg.pause_mode, self.update_requirement
        report = await publish(lambda: self.fleet.run_cycle(update, mode=mode), self.pool, requirement, version)
        if self.weight_sync is None:
            for old in self.weights_root.glob("v*"):
                if old.name[1:].isdigit() and int(old.name[1:]) <= version - KEEP_WEIGHT_VERSIONS:
                    await asyncio.to_thread(shutil.rmtree, old, True)
        else:  # what one engine received
            full_bytes = report.update.bytes_sent if isinstance(report.update, SyncResult) else 0
        updated = len(report.updated)
        sent = float(full_bytes * updated)
        return {
            **report.phases,
            "prepare_s": prepare_s,
            "bytes_sent": sent,
            "bytes_per_engine": sent / updated if updated else 0.0,
            "delta": 0.0,
            "full_engines": float(updated),
            "delta_share": 0.0,
        }

    async def _publish_delta(self, delta: DeltaSync, version: int) -> dict[str, float]:
        """`_publish_weights` with delta_sync (trainer/delta_sync.py): before the pause, the new weights in the sync
        dtype, the decision (a delta from the last published version, or a full update), and the delta prepared by
        every engine on its base; under the pause, each engine swaps in what it prepared or loads the full version.
        Disk: `d{N}/` and (when some engine needs it) `v{N}/` under weights_root. Distributed: the delta's blob is
        broadcast to every engine while they generate, then swapped in (/rollq/swap_prepared_weights)."""
        started = time.monotonic()
        new = await delta.gather(self.policy)
        reconciled: list[str] = []
        if self.weight_sync is None and delta.snapshot_version is not None and self.pool.engines(stale_only=True):
            await delta.ensure_full(delta.snapshot_version)  # the last version, which stale engines catch up with
            reconciled = (await self.fleet.reconcile()).ok  # (then they are on the delta's base)
        members = self.pool.engines()
        if self.weight_sync is not None:  # a group holding an engine that cannot take deltas (SGLang) gets full
            unable = [m.url for m in members if m.url in delta.cannot_prepare]  # broadcasts: no delta is even taken
            no_delta = f"engines without deltas: {unable}" if unable else ""
        else:  # no engine takes deltas over disk (plain SGLang, engines holding no weights): none is taken
            takes = delta.takes_disk_deltas(members, version)
            no_delta = "no engine prepares deltas (their prepare answered 404)" if members and not takes else ""
        update = await delta.decide(version, new, no_delta=no_delta)
        update.reconciled = reconciled
        step: Callable[[], Awaitable[FleetResult]]
        if self.weight_sync is None:
            if update.delta is not None:
                await delta.prepare_disk(update, members)
            await delta.prepare_full_on_agents(update, members)
            if any(m.url not in update.loads for m in members):
                await delta.ensure_full(update.version)  # written before the pause, not under it
            step = functools.partial(
                self.fleet.update_weights_each,
                version,
                update.loads,
                str(delta.full_dir(version)),
                full=functools.partial(delta.ensure_full, update.version),
            )
        else:
            prepared = await delta.prepare_distributed(update, members, self.weight_sync) if update.delta else []
            step = self._swap_prepared(self.weight_sync, update, prepared)
        update.prepare_s = time.monotonic() - started
        mode, requirement = self.cfg.pause_mode, self.update_requirement
        report = await publish(lambda: self.fleet.run_cycle(step, mode=mode), self.pool, requirement, version)
        full = report.update.full if isinstance(report.update, LoadResult) else list(report.updated)
        phases = update.phases(report.updated, full)
        delta.commit(update, delta_sent=phases["delta"] > 0)
        if self.weight_sync is None:
            await delta.prune(version, KEEP_WEIGHT_VERSIONS)
        return {**report.phases, **phases}

    def _swap_prepared(
        self, sync: DistributedWeightSync, update: Update, prepared: list[EngineMember]
    ) -> Callable[[], Awaitable[FleetResult]]:
        """The update step of a distributed delta sync: the engines that prepared the delta swap it in; any other
        (none prepared, one refused the swap, one joined since) gets the full weights broadcast, in the sync dtype."""
        version, bucket_bytes = update.version, int(self.cfg.publish_bucket_mb * (1 << 20))

        def full_weights() -> Iterator[list[tuple[str, torch.Tensor]]]:
            return buckets_of(iter(update.new.items()), bucket_bytes)

        async def step() -> FleetResult:
            if not prepared:
                return await self._broadcast(sync, version, full_weights)()  # every engine: the full weights
            swap = await self.fleet.swap_prepared(version, prepared)
            swapped = set(swap.ok)
            others = [m for m in self.pool.engines() if m.url not in swapped]
            if not others:
                return LoadResult(ok=swap.ok, failed={}, seconds=swap.seconds, load_seconds=swap.load_seconds)
            if swap.failed:
                log.warning("weights %s: the full weights to %d engines that did not swap", version, len(others))
            full = await self._broadcast(sync, version, full_weights, members=others)()
            return LoadResult(
                ok=swap.ok + full.ok,
                failed=full.failed,
                seconds=swap.seconds + full.seconds,
                load_seconds=max(swap.load_seconds, full.load_seconds),
                full=[m.url for m in others],
            )

        return step

    async def _publish_adapter(self, version: int) -> dict[str, float]:
        """A LoRA run's adapter of `version` onto the engines beside the versions before it: no pause, no flush, no
        full weights. Groups admitted at `version` name it (trainer/feeder.py); requests in flight keep theirs.
        Versions no group can be trained from any more (older than version - max_staleness - 1) are unloaded in the
        background. Version 0 is the base model: nothing to load."""
        if version == 0:
            return {
                "pause_s": 0.0,
                "update_s": 0.0,
                "resume_s": 0.0,
                "total_s": 0.0,
                "load_s": 0.0,
                "control_s": 0.0,
                "paused_s": 0.0,
            }
        save_adapter = getattr(self.policy, "save_adapter", None)
        if save_adapter is None:
            raise TypeError("lora_publish adapter needs a policy with save_adapter (rollq's own Policy)")
        if not self._adapters_loaded:  # a resumed run: what an earlier life loaded is unloaded in its turn
            self._adapters_loaded = sorted(await self._adapter_versions_on_engines() - {version})
        path = await asyncio.to_thread(save_adapter, self.weights_root / f"adapter-v{version}")
        name = adapter_name(self.adapter_family, version)
        report = await publish(
            lambda: self.fleet.load_adapter(name, str(path)), self.pool, self.update_requirement, version
        )
        self._adapters_loaded.append(version)
        keep_from = version - self.cfg.max_staleness - 1
        for old in [v for v in self._adapters_loaded if v < keep_from]:
            self._adapters_loaded.remove(old)
            task = asyncio.create_task(self._unload_adapter(old), name=f"unload-adapter-v{old}")
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)
        return report.phases

    async def _adapter_versions_on_engines(self) -> set[int]:
        """The versions of this run's adapters the engines hold now (an earlier life of the trainer loaded them)."""
        prefix = adapter_name(self.adapter_family, 0)[:-1]
        found: set[int] = set()
        for member in self.pool.engines():
            try:
                names = await member.client.adapters()
            except (EngineError, EngineUnavailable):
                continue
            found.update(int(n[len(prefix) :]) for n in names if n.startswith(prefix) and n[len(prefix) :].isdigit())
        return found

    async def _unload_adapter(self, version: int) -> None:
        result = await self.fleet.unload_adapter(adapter_name(self.adapter_family, version))
        if not result.failed:
            await asyncio.to_thread(shutil.rmtree, self.weights_root / f"adapter-v{version}", True)

    def _broadcast(
        self,
        sync: DistributedWeightSync,
        version: int | str,
        weights: Callable[[], Iterator[list[tuple[str, torch.Tensor]]]] | None = None,
        members: list[EngineMember] | None = None,
    ) -> Callable[[], Awaitable[FleetResult]]:
        """The update step of a cycle without a shared disk: broadcast to every engine (stale and newly joined ones
        included: each update covers the whole pool, over a group rebuilt when membership changed), bucket by bucket
        (`publish_bucket_mb`: the full weights are never whole in one process; on N ranks each bucket is gathered
        from the shards), the engines that took every bucket so far receiving the next. An in_place pause keeps KV
        in the running batch, so the engines must not be asked to flush their cache (SGLang would load the weights
        and still fail the call); otherwise the last bucket flushes it. `weights`: the buckets to send (default: the
        policy's, gathered); `members`: only these engines (default: every one)."""
        flush = self.cfg.pause_mode != "in_place"
        policy, pool, bucket_bytes = self.policy, self.pool, int(self.cfg.publish_bucket_mb * (1 << 20))
        first = members

        async def update() -> FleetResult:
            buckets = policy.gather_weights(bucket_bytes) if weights is None else weights()
            results: list[FleetResult] = []
            members = first
            try:
                bucket = await asyncio.to_thread(next, buckets, None)
                while bucket is not None:
                    following = await asyncio.to_thread(next, buckets, None)
                    last = following is None
                    result = await sync.update(bucket, version, flush_cache=flush and last, members=members)
                    results.append(result)
                    members = [m for m in pool.engines() if m.url in result.ok]
                    if not members:
                        break
                    bucket = following
            finally:
                close = getattr(buckets, "close", None)  # a generator's: the rest of the gathers, which the other
                if close is not None:  # ranks take part in, run to the end
                    await asyncio.to_thread(close)
            return merged_results(results)

        return update

    # -- the loop ------------------------------------------------------------------------------------------------------

    async def _wait_for_engines(self) -> None:
        """Engines may start after the trainer (compose, registry, a gateway they join): wait for one, saying so."""
        waited = 0.0
        while not self.pool.engines():  # a gateway without engines is none: its list is followed until one joins
            if waited % 30 == 0:
                log.warning("no engine yet (none configured, none registered for run %r): waiting", self.cfg.run)
            await asyncio.sleep(0.5)
            waited += 0.5

    async def _check_fleet_model(self) -> None:
        """A shared fleet serves one base model; an adapter of another model's shapes would not load, and one of the
        same shapes would be served on the wrong weights: refuse to start unless every engine serves this run's."""
        want = Path(model_dir(self.cfg.model)).resolve()
        for member in self.pool.engines():
            served = str((await member.client.model_info()).get("model_path", ""))
            if not served or Path(served).resolve() != want:
                raise ValueError(
                    f"fleet {self.cfg.fleet!r}: engine {member.url} serves {served or 'an unknown model'}, and this "
                    f"run trains {self.cfg.model} ({want}): only LoRA runs on the fleet's base model share it"
                )

    async def run(self) -> list[StepRecord]:
        """Train `steps` steps; with `metrics_port` set, /metrics is served meanwhile (trainer/prometheus_metrics)."""
        if not self.cfg.metrics_port:
            return await self._run()
        from rollq.trainer.prometheus_metrics import TrainerMetrics

        server = TrainerMetrics(self.cfg, self.pool, self.metrics).serve(self.cfg.metrics_port, self.cfg.metrics_host)
        try:
            return await self._run()
        finally:
            server.close()

    async def _read_blob(self, job_id: str, digest: str) -> bytes | None:
        """A blob a worker stored for a sample of `job_id` (its images), from the job's partition; None if gone."""
        keys = RunKeys(self.cfg.run).at(partition_of(job_id, await self.producer.partitions()))
        return await self.redis.get(keys.blob(digest))

    def _trace_trained(self, groups: list[Group], step: int, version: int, started_ns: int) -> None:
        """Each trained sample's `train` span, in its trace (a child of the worker's attempt): the step's training
        time, the step, the policy version trained and how far behind it the sample's tokens were."""
        ended = time.time_ns()
        for group in groups:
            for t in group.samples:
                if not t.traceparent:
                    continue
                produced = [int(v) for s in t.sequences for v in s.versions if v >= 0]
                span = self.tracing.start(
                    "train",
                    parent=t.traceparent,
                    attributes={
                        **sample_attributes(t),
                        "rollq.step": step,
                        "rollq.version": version,
                        "rollq.staleness": version - min(produced) if produced else 0,
                    },
                    start_time=started_ns,
                )
                span.end(end_time=ended)

    async def _run(self) -> list[StepRecord]:
        cfg = self.cfg
        if cfg.join_late and not self.policy.fused_prox:
            raise ValueError(
                "join_late needs one optimizer step per batch (ppo_minibatches 1) and a model without dropout"
            )
        if cfg.join_late and self.policy.ranks.distributed:
            raise ValueError("join_late runs on one trainer rank (nproc 1)")
        if cfg.pause_mode == "in_place":
            log.warning(
                "pause_mode in_place: an engine's prefix cache cannot be flushed while requests sit in its running "
                "batch, so new requests may reuse prompt KV computed by older weights (SGLang behaves the same); "
                "use retract (the default) or abort, or engines without a prefix cache, when that matters"
            )
        await self.pool.start()
        await self._wait_for_engines()
        if cfg.fleet:
            await self._check_fleet_model()
        resumed = await self._resume()
        if cfg.trained_log:
            self._cut_trained_log(self.state.step)
        self.samples.cut(self.state.step)  # the steps redone from here are written again
        await self.ride(self.producer.partitions, "reading the run's partitions")
        self.consumer = self.producer.consumer(group=CONSUMER_GROUP, name=CONSUMER_NAME, wait=self.replica_wait)
        streams = self.consumer.streams if isinstance(self.consumer, PartitionedConsumer) else [self.consumer.stream]
        self.cluster_view.watch([self.ledger.keys.ledger, *streams])  # the shards of the ledger and of each partition
        await self.ride(self.consumer.setup, "creating the results group")
        self._resumed = True
        await self._publish_weights(self.state.version)  # engines start from the trainer's weights
        prefix = f"{self.state.run_id}-g"
        self.feeder = GroupFeeder(
            self.producer,
            self.ledger,
            self.prompts,
            prefix=prefix,
            group_size=cfg.group_size,
            workflow=cfg.workflow,
            workflow_kwargs=cfg.job_kwargs(),
            agent=cfg.agent_options(),
            next_index=self.state.next_group,
            reoffer_after_s=cfg.reoffer_after_s,
            priority_by_age=cfg.priority_by_age,
            adapter_family=self.adapter_family,
            ride=self.ride,
        )
        self.collector = GroupCollector(
            self.consumer,
            self.ledger,
            group_prefix=prefix,
            max_staleness=cfg.max_staleness,
            vocab_size=self.policy.vocab_size,
            stale_policy=cfg.stale_policy,
            partial_groups=cfg.partial_groups,
            split_groups=cfg.split_groups,
            on_release=self.feeder.notify,
            on_settled=self.feeder.settled,
            give_up_after=2 * cfg.batch_samples,  # two steps' worth (trainer/nothing_trains.py)
            filter_groups=cfg.dynamic_sampling_budget * cfg.groups_per_step if cfg.dynamic_sampling else 0,
            ride=self.ride,
            takes_images=bool(getattr(self.policy, "takes_images", False)),  # a policy of the seam may have none
            image_token_id=getattr(self.policy, "image_token_id", None),
            read_blob=self._read_blob,
            tracing=self.tracing,
        )
        self.collector.skip = set(self.state.unacked_groups)
        self.collector.settled = self.state.settled
        self.collector.parts = self.state.split
        # Groups admitted before a restart and not settled yet: watched for a vanished submission like new ones (a
        # checkpoint from before settled groups were recorded has none: its groups are not watched).
        if self.state.step == 0 or self.state.settled.below or self.state.settled.above:
            self.feeder.watch(self.state.settled.unsettled(self.state.next_group))
        if resumed:  # Redis may have lost ledger writes of the previous life (it and a Redis primary died together)
            feeder, collector = self.feeder, self.collector
            expected = self.fresh_redis  # in a fresh Redis every write of the previous life is "lost": say so calmly
            await self.ride(
                lambda: repair_ledger(self.ledger, feeder, collector, fresh=expected), "writing the ledger again"
            )
        log.info(
            "%s at step %d (policy version %d); %d steps to go",
            "resumed" if resumed else "starting",
            self.state.step,
            self.state.version,
            cfg.steps - self.state.step,
        )
        self._started = time.monotonic()
        self._rates = RateWindow(RATE_WINDOW_S, self._started)
        feeding = asyncio.create_task(self.feeder.run(), name="feeder")
        try:
            if self.state.step == 0:
                await self._evaluate()  # the model before training
            while self.state.step < cfg.steps:
                step = asyncio.create_task(self._step())
                try:
                    await asyncio.wait([step, feeding], return_when=asyncio.FIRST_COMPLETED)
                except asyncio.CancelledError:  # the run is cancelled (a seam session closed early): its step too
                    step.cancel()
                    await asyncio.wait([step], timeout=10)
                    raise
                if feeding.done():  # the feeder only ends by failing: surface it
                    step.cancel()
                    await asyncio.gather(step, return_exceptions=True)
                    feeding.result()
                step.result()
                for done in self.step_done:
                    done()
        finally:
            self.feeder.stop()
            feeding.cancel()
            await asyncio.wait([feeding], timeout=10)
            if self.weight_sync is not None:  # the engines drop the group (its sockets) now, not at their next join
                await self.weight_sync.close()
            if self._unloads:  # each ends once that version's requests in flight have (bounded: it keeps it then)
                _, late = await asyncio.wait(list(self._unloads), timeout=UNLOAD_WAIT_S)
                for unload in late:
                    unload.cancel()
            await asyncio.to_thread(self.tracing.shutdown)  # exports the spans still buffered
        records = self.metrics.read()
        await self._plot(records)
        return records

    async def _plot(self, records: list[StepRecord]) -> None:
        if records:
            title, evals = f"rollq run {self.cfg.run}", self.metrics.read_evals()
            await asyncio.to_thread(plot, records, self.run_dir / PLOT_FILE, title, evals)

    async def _evaluate(self) -> None:
        """Held-out evaluation of the weights the engines hold now (eval_dataset; a no-op without one)."""
        if self.evaluator is None:
            return
        evaluator, state = self.evaluator, self.state
        lora = adapter_name(self.adapter_family, state.version) if self.adapter_family and state.version else ""
        record = await self.ride(lambda: evaluator.evaluate(state.step, state.version, lora), "evaluating")
        self.metrics.write_eval(record)

    def _late_joiner(
        self, version: int, min_version: int | None, joined: list[tuple[Collected, Batch | None]]
    ) -> Callable[[], Batch | None]:
        """join_late: called from the training thread once the step's batch is through its passes; what finished
        meanwhile and would pass the bound at the next update (collect_at_risk) joins the step's optimizer step."""
        assert self.collector is not None
        collector, event_loop, pad_id = self.collector, asyncio.get_running_loop(), self.policy.pad_id
        std_norm = self.cfg.adv_std_norm

        def late() -> Batch | None:
            extra = asyncio.run_coroutine_threadsafe(collector.collect_at_risk(version), event_loop).result()
            if not extra.groups and not extra.dropped:
                return None
            extra_batch = build_batch(extra.groups, pad_id, min_version, std_norm) if extra.groups else None
            joined.append((extra, extra_batch))  # its drops count too
            return extra_batch

        return late

    async def _step(self) -> None:
        cfg, state = self.cfg, self.state
        assert self.collector is not None and self.feeder is not None
        t0 = time.monotonic()
        # Pacing waits before collecting, not after training: groups that complete meanwhile train at this step,
        # younger by the wait (the previous step's train time estimates this one's).
        early = max(0.0, cfg.min_step_s - self._train_estimate_s)
        if early:
            await asyncio.sleep(early)
        dropped_before = self.collector.dropped_tokens
        got = await self.collector.collect(cfg.groups_per_step, state.version)
        t1 = time.monotonic()
        min_version = state.version - cfg.max_staleness if cfg.stale_policy == "mask" else None
        batch = build_batch(got.groups, self.policy.pad_id, min_version, cfg.adv_std_norm)
        joined: list[tuple[Collected, Batch | None]] = []  # join_late: what joined the step while it trained
        joiner = self._late_joiner(state.version, min_version, joined) if cfg.join_late else None
        train_started_ns = time.time_ns()
        stats = await asyncio.to_thread(self.policy.train_step, batch, joiner)
        late_samples, batches = 0, [batch]
        for extra, extra_batch in joined:
            got = got.merged(extra)
            late_samples += sum(len(g.samples) for g in extra.groups)
            batches += [extra_batch] if extra_batch is not None else []
        # the groups filtered out (dynamic_sampling) count too: the reward is the policy's, not only what trained
        rewards = torch.cat([b.rewards for b in batches] + [torch.tensor(got.filtered_rewards, dtype=torch.float32)])
        t2 = time.monotonic()
        self._train_estimate_s = t2 - t1
        late = max(0.0, cfg.min_step_s - (t2 - t0))
        if late:  # the estimate was short: publish no sooner than min_step_s anyway
            await asyncio.sleep(late)
        paced = early + late  # fewer weight updates while long answers generate (the engines go on meanwhile)
        phases = await self._publish_weights(state.version + 1)
        t3 = time.monotonic()

        state.step += 1
        state.version += 1
        state.next_group = self.feeder.next_index
        trained_now = sum(len(g.samples) for g in got.groups)  # a partial group's survivors only
        admitted_at = [self.feeder.settled_versions.get(g.job_id) for g in got.groups]
        lags = [state.version - 1 - v for v in admitted_at if v is not None]  # the version trained: before the +1
        self.feeder.settled_versions.clear()
        waits = [t.started_at - t.submitted_at for g in got.groups for t in g.samples if t.submitted_at]
        state.trained_samples += trained_now
        state.dropped = dict(Counter(state.dropped) + Counter(got.dropped))
        state.staleness = dict(Counter(state.staleness) + Counter(got.staleness))
        # groups handed out whole or their last part (a group still in `parts` has its rest to come)
        state.unacked_groups += list(
            dict.fromkeys(g.job_id for g in got.groups if g.job_id not in self.collector.parts)
        )
        state.settled = self.collector.settled  # those just trained included: what the checkpoint's model has
        state.split = self.collector.parts
        self._unacked += got.deliveries
        self._unacked_parts += got.part_samples
        ledger = await self.ride(self.ledger.state, "reading the ledger")
        trained = sum(got.staleness.values())
        samples_per_s, tokens_per_s = self._rates.rates(
            t3, self.collector.samples_read, self.collector.model_tokens_read
        )
        self.metrics.write(
            StepRecord(
                step=state.step,
                version=state.version,
                reward_mean=float(rewards.mean()),
                reward_max=float(rewards.max()),
                reward_min=float(rewards.min()),
                samples=trained_now,
                trained_samples=state.trained_samples,
                groups=[g.job_id for g in got.groups],
                dropped=dict(state.dropped),
                dropped_this_step=got.dropped,
                staleness_mean=sum(k * n for k, n in got.staleness.items()) / max(1, trained),
                staleness_max=max(got.staleness, default=0),
                staleness_hist={str(k): n for k, n in sorted(got.staleness.items())},
                trained_tokens=sum(b.tokens for b in batches),
                masked_tokens=sum(b.masked_tokens for b in batches),
                dropped_tokens=self.collector.dropped_tokens - dropped_before,
                trained_sample_tokens=sum(g.model_tokens for g in got.groups),
                generated_tokens=self.collector.model_tokens_read,
                partial_groups=got.partial_groups,
                split_parts=got.split_parts,
                late_samples=late_samples,
                filtered_groups=got.filtered_groups,
                filtered_samples=got.dropped.get("filtered", 0),
                paced_s=paced,
                admission_lag_mean=sum(lags) / len(lags) if lags else 0.0,
                queue_s_mean=sum(waits) / len(waits) if waits else 0.0,
                gen_tokens_per_s=tokens_per_s,
                samples_per_s=samples_per_s,
                collect_s=t1 - t0 - early,
                train_s=t2 - t1,
                step_s=t3 - t0,
                pause_s=phases["paused_s"],
                publish_s=phases.get("prepare_s", 0.0) + phases["total_s"],  # before the pause, then the cycle
                weight_load_s=phases["load_s"],
                **update_fields(phases, adapter=bool(self.adapter_family)),
                ledger_version=ledger.version,
                ledger_admitted=ledger.admitted,
                ledger_limit=self.ledger.limit(ledger.version),
                elapsed_s=self._elapsed_before + time.monotonic() - self._started,
                time=time.time(),
                train=stats,
            ),
            cfg.steps,
        )
        if self.tracing.enabled:
            self._trace_trained(got.groups, state.step, state.version - 1, train_started_ns)
        if cfg.trained_log:  # the policy version trained is the one before this step's update
            self._log_trained(state.step, state.version - 1, got.groups, min_version)
        if self.samples.due(state.step):
            await asyncio.to_thread(self.samples.write, state.step, state.version - 1, got.groups)
        if state.step % cfg.checkpoint_every == 0 or state.step == cfg.steps:
            await asyncio.to_thread(checkpoint.save, self.run_dir, self.policy, state)
            unacked = self._unacked
            await self.ride(lambda: self.consumer.commit(unacked), "acking trained samples")  # the checkpoint has them
            self.collector.committed(state.unacked_groups, self._unacked_parts)
            self._unacked = []
            self._unacked_parts = []
            state.unacked_groups = []
        # New admissions only against versions a checkpoint knows (with checkpoint_every 1: always).
        await self.ride(lambda: self.ledger.set_version(state.version), "publishing the policy version")
        self.feeder.notify()
        if state.step == cfg.steps or (cfg.eval_every and state.step % cfg.eval_every == 0):
            await self._evaluate()
        if state.step % PLOT_EVERY_STEPS == 0 and state.step < cfg.steps:
            await self._plot(self.metrics.read())


def merged_results(results: list[FleetResult]) -> FleetResult:
    """One update in buckets as one result: the engines that took the last bucket sent (each took every one before
    it), every failure, the time of all of them."""
    if not results:
        return SyncResult(ok=[], failed={}, seconds=0.0)
    failed: dict[str, str] = {}
    for r in results:
        failed.update(r.failed)
    return SyncResult(
        ok=[u for u in results[-1].ok if u not in failed],
        failed=failed,
        seconds=sum(r.seconds for r in results),
        load_seconds=sum(r.load_seconds for r in results),
        bytes_sent=sum(r.bytes_sent for r in results if isinstance(r, SyncResult)),  # what each engine received
    )


def safetensors_bytes(directory: Path) -> int:
    """The bytes of a weights directory's safetensors files: what each engine reads to load it."""
    if directory.is_file():
        return directory.stat().st_size
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


__all__ = ["Trainer", "merged_results", "safetensors_bytes"]
