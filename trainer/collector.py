"""The consumption side of the staleness bound: trajectories -> complete groups fresh enough to train.

A group trains at policy version v only if every trained token was produced by a version in [v - eta, v]. A group
that fails this, or holds a failed/rejected sample, is dropped whole: its samples are acked, counted and given back
to the ledger. Versions above v come from weights a crashed trainer published but never checkpointed; they are
dropped too, so every trained token's version names weights the trainer still has in its history.

With split_groups, a group whose finished samples would pass the bound while its stragglers decode trains in parts:
the finished samples at this step (advantages over them), the rest when the group completes (advantages over the
whole group). The parts trained are kept with the checkpoint (`TrainedPart`), so each sample still trains once.

With filter_groups (DAPO's dynamic sampling), a complete group whose rewards are all equal (`Group.uniform`: every
advantage zero) is dropped as `filtered` like any drop: acked, settled and given back at once, so the feeder admits
another in its place and the step waits for groups that teach something. At most filter_groups per step (per
collect()): past that the rest train (zero advantage) after those with a signal, so a policy that solved the task
(every group all 1.0) still steps, and every step still trains B samples. Their rewards are handed out with the step
(`filtered_rewards`) so its reward metrics describe the policy, not only the groups with a signal. Filtering is a
drop, not a deferred ack: a filtered group is never read again after a restart, and the auditor counts it with the
ledger's give-backs (`released:filtered`).
"""

from __future__ import annotations

import collections
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from fractions import Fraction
from functools import partial

import msgspec

from rollq.producer.results import Delivered, PartitionedConsumer, ResultConsumer
from rollq.protocol.blobs import digest_of
from rollq.protocol.messages import ErrorRecord, Trajectory, VisionRef
from rollq.tracing import Tracing, sample_attributes
from rollq.trainer.batch import Group, model_tokens
from rollq.trainer.ledger import Ride, StalenessLedger, direct
from rollq.trainer.nothing_trains import FruitlessStreak, NothingTrains
from rollq.trainer.settled import SettledGroups, TrainedPart

log = logging.getLogger("rollq.trainer")

REPORT_EVERY_S = 30.0  # a step waiting longer than this says what it waits for
DROP_REASONS = ("stale", "failed", "invalid", "future", "foreign", "filtered")
ONE = Fraction(1)


class Collected(msgspec.Struct, kw_only=True):
    groups: list[Group]
    deliveries: list[Delivered]  # acked once the step that trains them is checkpointed
    staleness: dict[int, int]  # trained samples per staleness (v - oldest token version)
    dropped: dict[str, int]  # samples dropped while collecting, per reason
    partial_groups: int = 0  # groups handed out that train on their survivors only
    split_parts: int = 0  # parts of groups handed out ahead of their stragglers (split_groups)
    part_samples: list[tuple[str, int]] = []  # their samples: (group id, sample index)
    filtered_groups: int = 0  # groups dropped as `filtered` (all rewards equal; their samples in dropped too)
    filtered_rewards: list[float] = []  # their sequences' rewards: the step's reward metrics count them

    def merged(self, other: Collected) -> Collected:
        """Both hand-outs as one (a step's groups and those that joined it late)."""
        return Collected(
            groups=self.groups + other.groups,
            deliveries=self.deliveries + other.deliveries,
            staleness=dict(Counter(self.staleness) + Counter(other.staleness)),
            dropped=dict(Counter(self.dropped) + Counter(other.dropped)),
            partial_groups=self.partial_groups + other.partial_groups,
            split_parts=self.split_parts + other.split_parts,
            part_samples=self.part_samples + other.part_samples,
            filtered_groups=self.filtered_groups + other.filtered_groups,
            filtered_rewards=self.filtered_rewards + other.filtered_rewards,
        )


class _Ready(msgspec.Struct):
    """A complete group that passed the version-independent checks, with its trained tokens' version span."""

    items: list[Delivered]
    group: Group
    span: tuple[int, int] | None  # (oldest, newest); None: nothing to train on


class GroupCollector:
    """Reads a results stream, assembles groups by job id and hands out the ones fit to train."""

    def __init__(
        self,
        consumer: ResultConsumer | PartitionedConsumer,
        ledger: StalenessLedger,
        *,
        group_prefix: str,
        max_staleness: int,
        vocab_size: int,
        stale_policy: str = "drop",
        partial_groups: int = 0,
        split_groups: int = 0,
        on_release: Callable[[], None] = lambda: None,
        on_settled: Callable[[str], None] = lambda job_id: None,
        give_up_after: int = 0,
        filter_groups: float = 0,
        ride: Ride | None = None,
        takes_images: bool = False,
        image_token_id: int | None = None,
        read_blob: Callable[[str, str], Awaitable[bytes | None]] | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.tracing = tracing or Tracing.disabled()  # a dropped sample's `drop` span, in its trace
        self.ride: Ride = ride or direct  # every Redis call: the trainer's rides out an outage
        self.takes_images = takes_images  # the model has a vision tower: groups with images may train
        self.image_token_id = image_token_id  # its image token: in a sequence, only where its images go
        # (job id, digest) -> a stored blob (a sequence's images by reference) or None when it is gone
        self.read_blob = read_blob
        self.consumer = consumer
        self.ledger = ledger
        self.group_prefix = group_prefix  # this trainer's job ids; anything else is left from an earlier run
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy  # "drop": a group with a token past the bound; "mask": one with none within
        self.dropped_tokens = 0  # generated tokens of every sample dropped so far (any reason)
        # > 0: a group with failed samples trains on its survivors when at least this many are left
        self.partial_groups = partial_groups
        self._partial_ids: set[str] = set()  # complete groups that train on their survivors only
        # > 0: a group's finished samples train ahead of its stragglers once this many are finished (at least 2)
        self.split_groups = split_groups
        # Groups trained in part, by id (the checkpoint keeps it): a copy of a trained sample read later is acked
        self.parts: dict[str, TrainedPart] = {}
        self._taken_samples: set[tuple[str, int]] = set()  # samples of parts handed out, not committed yet
        self.vocab_size = vocab_size
        # > 0: dynamic sampling, at most this many groups without a signal (rounded up) dropped as `filtered` per
        # collect()
        self.filter_groups = filter_groups
        self._filtered = 0  # groups filtered since the current step's collect() began (its budget)
        self._filtered_out: list[list[float]] = []  # rewards of each group filtered, not handed out yet
        self.filtered_groups = 0  # groups filtered so far (whole life)
        self.on_release = on_release
        self.on_settled = on_settled  # a group was handed out to train or dropped: nothing more is expected of it
        # Groups trained or dropped (the checkpoint keeps it): a copy of one of their samples read later is acked,
        # never trained. It comes when Redis lost the commit of a trained group (a failover's last writes, AOF
        # everysec), so its entries are read again although the consumer marked them consumed.
        self.settled = SettledGroups()
        # (group, reason, samples) given back to the ledger lately: written again should Redis lose them
        # (Trainer._recover); samples None: the whole group, else what a split group had not trained
        self.recent_drops: collections.deque[tuple[str, str, int | None]] = collections.deque(maxlen=4096)
        self.skip: set[str] = set()  # trained before a restart, awaiting their ack
        self._partial: dict[str, list[Delivered]] = {}
        self._complete: dict[str, _Ready] = {}  # complete groups not trained yet (their versions checked each step)
        # samples in a row that failed or generated no token that stop the run (trainer/nothing_trains.py; 0: never)
        self.fruitless = FruitlessStreak(give_up_after)
        self._last_report = time.monotonic()
        self.samples_read = 0  # every trajectory of this run read so far (trained, waiting or dropped)
        self.settled_copies = 0  # samples of groups already trained or dropped, read again (acked, not trained)
        self.duplicates = 0  # second copies of a sample held here, uncommitted (the consumer's dedup can't see them)
        self._taken: set[str] = set()  # groups handed out by collect() whose samples are not committed yet
        self.model_tokens_read = 0  # their generated tokens

    @property
    def waiting_samples(self) -> int:
        return sum(map(len, self._partial.values())) + sum(len(r.items) for r in self._complete.values())

    def _unfit(self, group: Group) -> str | None:
        """Why a group can never train, whatever the version (checked once, when it completes)."""
        if not group.ok:
            return "failed"
        why = group.invalid(self.vocab_size, self.takes_images, self.image_token_id)
        if why is not None:
            log.warning("group %s can't be trained: %s", group.job_id, why)
            return "invalid"
        return None

    def _out_of_bound(self, span: tuple[int, int] | None, version: int) -> str | None:
        if span is None:
            return None  # nothing to train on, nothing stale (it still counts as a sample of the step)
        oldest, newest = span
        if newest > version:
            return "future"
        # mask: the tokens older than the bound are masked out of the loss (build_batch), the rest trains
        if (newest if self.stale_policy == "mask" else oldest) < version - self.max_staleness:
            return "stale"
        return None

    def index_of(self, job_id: str) -> int | None:
        """The group index in one of this run's group ids (`{prefix}{index}`)."""
        tail = job_id[len(self.group_prefix) :]
        return int(tail) if job_id.startswith(self.group_prefix) and tail.isdigit() else None

    def _settle(self, job_id: str) -> None:
        index = self.index_of(job_id)
        if index is not None:
            self.settled.add(index)
        self.on_settled(job_id)

    async def _completed(self, job_id: str, items: list[Delivered], dropped: Counter) -> None:
        if job_id in self.skip:  # trained and checkpointed before a crash: ack only
            self.skip.discard(job_id)
            self._settle(job_id)
            await self.ride(lambda: self.consumer.commit(items), "acking a skipped group")
            return
        part = self.parts.get(job_id)
        trained_before = len(part.samples) if part else 0
        context = list(part.rewards) if part else []
        group = Group(job_id=job_id, samples=[d.trajectory for d in items], context_rewards=context)
        reason = self._unfit(group)
        if reason == "failed" and self.partial_groups:
            ok = [t for t in group.samples if t.status == "ok" and t.sequences]
            survivors = Group(job_id=job_id, samples=ok, context_rewards=context)
            enough = ok and len(ok) + trained_before >= self.partial_groups
            if enough and survivors.invalid(self.vocab_size, self.takes_images, self.image_token_id) is None:
                await self._train_partially(job_id, items, group, survivors, dropped)
                return
        if reason is not None:
            await self._drop(job_id, items, reason, dropped)
        else:
            self._complete[job_id] = _Ready(items, group, group.version_range())

    async def _train_partially(
        self, job_id: str, items: list[Delivered], group: Group, survivors: Group, dropped: Counter
    ) -> None:
        """The group trains on its survivors (advantages normalised over them); its failed samples are counted as
        `failed` and given back to the ledger. All its entries are committed with the step that trains it, so a
        restarted trainer reads the whole group again."""
        failed = [t for t in group.samples if t not in survivors.samples]
        dropped["failed"] += len(failed)
        self.dropped_tokens += sum(model_tokens(t) for t in failed)
        await self.ride(lambda: self.ledger.release_part(job_id, len(failed), "failed"), "giving failed samples back")
        self.on_release()
        self._partial_ids.add(job_id)
        self._complete[job_id] = _Ready(items, survivors, survivors.version_range())
        kept = len(survivors.samples)
        log.info("group %s trains on %d of %d samples (%d failed)", job_id, kept, len(items), len(failed))

    async def _drop(
        self, job_id: str, items: list[Delivered], reason: str, dropped: Counter, held: Group | None = None
    ) -> None:
        """Ack the group's entries and give it back. `held`: the samples it still holds (a partial group: its
        survivors; its failed ones were counted and given back already)."""
        await self.ride(lambda: self.consumer.commit(items), "acking a dropped group")
        samples = held.samples if held is not None else [d.trajectory for d in items]
        if self.tracing.enabled:
            for t in samples:
                if t.traceparent:
                    self.tracing.start(
                        "drop", parent=t.traceparent, attributes={"rollq.reason": reason, **sample_attributes(t)}
                    ).end()
        dropped[reason] += len(samples)
        self.dropped_tokens += sum(model_tokens(t) for t in samples)
        if reason != "foreign":
            self._settle(job_id)
            if self.parts.pop(job_id, None) is not None:  # split: its parts trained earlier stay counted
                rest = len(samples)
                self.recent_drops.append((job_id, reason, rest))
                await self.ride(lambda: self.ledger.release_rest(job_id, rest, reason), "giving a group's rest back")
            else:
                self.recent_drops.append((job_id, reason, None))
                await self.ride(lambda: self.ledger.release(job_id, reason), "giving a group back to the ledger")
            self.on_release()
        detail = ""
        if reason == "failed":
            errors = [
                f"{t.error.type}: {t.error.message}" if t.error else t.status
                for t in (d.trajectory for d in items)
                if t.status != "ok"
            ]
            detail = f" ({errors[0]})" if errors else ""
        # filtered groups are routine (a batch's worth each step once the task is learnt): not a line each
        level = logging.DEBUG if reason == "filtered" else logging.INFO
        log.log(level, "dropped group %s (%d samples): %s%s", job_id, len(items), reason, detail)

    def _held_already(self, job_id: str, sample_index: int) -> bool:
        """A second copy of a sample this collector holds and has not committed (a worker that lost its lease
        published it too). The consumer drops duplicates of committed samples only, so this one must be dropped here:
        otherwise it would complete its group in place of a missing sample and be trained twice."""
        if job_id in self._complete or job_id in self._taken:
            return True
        return any(d.trajectory.sample_index == sample_index for d in self._partial.get(job_id, ()))

    async def _ack_duplicate(self, d: Delivered) -> None:
        """Ack the copy without marking its sample consumed (the held original is marked when it is committed; a
        trainer that dies before that reads the original again)."""
        c = self.consumer.parts[d.stream] if isinstance(self.consumer, PartitionedConsumer) else self.consumer
        await self.ride(lambda: c.redis.xack(c.stream, c.group, d.entry_id), "acking a duplicate")
        self.duplicates += 1
        log.info("dropped a duplicate of sample %d of group %s", d.trajectory.sample_index, d.trajectory.job_id)

    def committed(self, job_ids: list[str], part_samples: list[tuple[str, int]] | None = None) -> None:
        """The trainer committed these handed-out groups and parts: from now on the consumer drops their
        duplicates."""
        self._taken.difference_update(job_ids)
        self._taken_samples.difference_update(part_samples or ())

    def _parts_at_risk(self, version: int) -> Iterator[tuple[int, str, Group]]:
        """(oldest version, group id, part) for each unfinished group whose finished samples could train now and
        would pass the bound after the next update (their oldest trained token is v - eta), with enough of the
        group finished (split_groups, and at least 2: the advantages need a spread)."""
        for job_id, items in self._partial.items():
            part = self.parts.get(job_id)
            if not items or len(items) + (len(part.samples) if part else 0) < max(2, self.split_groups):
                continue
            if not all(d.trajectory.status == "ok" and d.trajectory.sequences for d in items):
                continue  # a failed sample decides the group's fate when it completes
            context = list(part.rewards) if part else []
            group = Group(job_id=job_id, samples=[d.trajectory for d in items], context_rewards=context)
            span = group.version_range()
            if span is None or span[0] > version - self.max_staleness or self._out_of_bound(span, version):
                continue
            if group.invalid(self.vocab_size, self.takes_images, self.image_token_id) is None:
                yield span[0], job_id, group

    def _hand_out_part(self, job_id: str, group: Group) -> list[Delivered]:
        """The group's finished samples train now; its stragglers stay expected."""
        items = self._partial.pop(job_id)
        part = self.parts.setdefault(job_id, TrainedPart())
        for t in group.samples:
            part.samples.append(t.sample_index)
            part.rewards += [s.reward for s in t.sequences]
            self._taken_samples.add((job_id, t.sample_index))
        return items

    async def collect(self, groups_needed: int, version: int, *, block_ms: int = 500) -> Collected:
        """Read until `groups_needed` complete groups may train at `version`. Stalest first, so the groups closest
        to the bound are the ones used. With split_groups, parts of groups count their share of a group.

        With filter_groups, groups without a signal are dropped (`filtered`) until this step has filtered that many;
        then they count like any, after those with a signal (zero advantage: a policy that solved the task must not
        stall the run). A step still trains `groups_needed` groups: B samples, as the ledger's bound counts them."""
        dropped: Counter = Counter()
        self._filtered = 0
        while True:
            fit, parts = await self._fit(version, dropped)
            if sum(f[2] for f in fit) >= groups_needed:
                break
            if time.monotonic() - self._last_report > REPORT_EVERY_S:
                self._last_report = time.monotonic()
                log.info(
                    "waiting for groups: %d of %d fit to train, %d samples of unfinished groups here",
                    len(fit),
                    groups_needed,
                    sum(map(len, self._partial.values())),
                )
            await self._read(dropped, block_ms)
        # stable: among equals, the first completed. Past the filter's budget, groups with a signal go first
        fit.sort(key=lambda f: (self._budget_spent and self._fit_group(f[1], parts).uniform, f[0]))
        chosen: list[tuple[int, str, Fraction]] = []
        taken = Fraction(0)
        for f in fit:
            if taken >= groups_needed:
                break
            taken += f[2]
            chosen.append(f)
        return self._hand_out(chosen, parts, version, dropped)

    async def collect_at_risk(self, version: int) -> Collected:
        """Without waiting: every group (and, with split_groups, part) read by now that may train at `version` and
        would pass the bound after the next update (its oldest trained token is v - eta). What finished while the
        step trained joins it this way (join_late), rather than the next step with a version more of age."""
        dropped: Counter = Counter()
        await self._read(dropped, block_ms=1)
        fit, parts = await self._fit(version, dropped)
        chosen = sorted((f for f in fit if f[0] <= version - self.max_staleness), key=lambda f: f[0])
        return self._hand_out(chosen, parts, version, dropped)

    async def _fit(self, version: int, dropped: Counter) -> tuple[list[tuple[int, str, Fraction]], dict[str, Group]]:
        """(oldest version, group id, groups' worth) of what may train at `version`, and the parts among them
        (split_groups). Complete groups past the bound are dropped here."""
        fit: list[tuple[int, str, Fraction]] = []
        for job_id, ready in list(self._complete.items()):
            reason = self._out_of_bound(ready.span, version) or self._filter(ready.group)
            if reason is not None:
                del self._complete[job_id]
                self._partial_ids.discard(job_id)
                await self._drop(job_id, ready.items, reason, dropped, ready.group)
                continue
            # a group's last part counts its share of the group
            worth = Fraction(len(ready.items), ready.items[0].trajectory.n) if job_id in self.parts else ONE
            fit.append((ready.span[0] if ready.span else version, job_id, worth))
        parts: dict[str, Group] = {}
        if self.split_groups:
            for oldest, job_id, group in self._parts_at_risk(version):
                fit.append((oldest, job_id, Fraction(len(group.samples), group.samples[0].n)))
                parts[job_id] = group
        return fit, parts

    @property
    def _budget_spent(self) -> bool:
        return self.filter_groups > 0 and self._filtered >= self.filter_groups

    def _fit_group(self, job_id: str, parts: dict[str, Group]) -> Group:
        return parts[job_id] if job_id in parts else self._complete[job_id].group

    def _filter(self, group: Group) -> str | None:
        """`filtered` for a group without a signal while this step's budget lasts (checked on every collect, so a
        group left to train past one step's budget is filtered at the next while it waits)."""
        if not self.filter_groups or self._budget_spent or not group.uniform:
            return None
        self._filtered += 1
        self.filtered_groups += 1
        self._filtered_out.append(group.rewards[len(group.context_rewards) :])  # earlier parts: counted when trained
        return "filtered"

    async def _read(self, dropped: Counter, block_ms: int) -> None:
        """One read of the results stream, each trajectory filed (or acked when it is not to be trained)."""
        for d in await self.ride(lambda: self.consumer.read(count=512, block_ms=block_ms), "reading results"):
            traj = d.trajectory
            if not traj.job_id.startswith(self.group_prefix):
                await self._drop(traj.job_id, [d], "foreign", dropped)
                continue
            if self._held_already(traj.job_id, traj.sample_index):
                await self._ack_duplicate(d)
                continue
            if self.index_of(traj.job_id) in self.settled:  # trained (or dropped) already: consumed, not again
                await self.ride(partial(self.consumer.commit, [d]), "acking a settled group's sample")
                self.settled_copies += 1
                continue
            part = self.parts.get(traj.job_id)
            if part is not None and traj.sample_index in part.samples:  # trained in an earlier part
                if (traj.job_id, traj.sample_index) in self._taken_samples:
                    await self._ack_duplicate(d)  # its original is committed with the step that trains it
                else:  # a checkpointed part whose commit a crash lost: consumed now
                    await self.ride(partial(self.consumer.commit, [d]), "acking a trained part's sample")
                    self.settled_copies += 1
                continue
            await self._read_images(traj)
            generated = model_tokens(traj)
            self.samples_read += 1
            self.model_tokens_read += generated
            self.fruitless.read(traj, generated)  # NothingTrains: samples that train nothing, one after another
            items = self._partial.setdefault(traj.job_id, [])
            items.append(d)
            if len(items) + (len(part.samples) if part else 0) >= traj.n:
                del self._partial[traj.job_id]
                await self._completed(traj.job_id, items, dropped)

    async def _read_images(self, traj: Trajectory) -> None:
        """Images stored by reference (Sequence.vision) read in now, checked against their digest: the batch is
        built without Redis. One that is gone or corrupt fails its sample, and so its group (`failed`)."""
        if not self.takes_images or traj.status != "ok":
            return
        for seq in traj.sequences:
            ref = seq.vision
            if ref is None or ref.inline is not None:
                continue
            payload = None
            if self.read_blob is not None:
                payload = await self.ride(partial(self.read_blob, traj.job_id, ref.digest), "reading images")
            if payload is None or digest_of(payload) != ref.digest:
                why = "gone from the blob store (past its retention)" if payload is None else "corrupt"
                traj.status = "error"
                traj.error = ErrorRecord(type="ImagesMissing", message=f"images {ref.digest[:16]}... {why}")
                log.warning("sample %s#%d can't be trained: its images are %s", traj.job_id, traj.sample_index, why)
                return
            seq.vision = VisionRef(digest=ref.digest, size=ref.size, inline=payload)

    def _hand_out(
        self, chosen: list[tuple[int, str, Fraction]], parts: dict[str, Group], version: int, dropped: Counter
    ) -> Collected:
        groups: list[Group] = []
        deliveries: list[Delivered] = []
        staleness: Counter = Counter()
        partials = 0
        part_samples: list[tuple[str, int]] = []
        filtered, self._filtered_out = self._filtered_out, []
        for oldest, job_id, _ in chosen:
            if job_id in parts:  # a part ahead of its stragglers
                group = parts[job_id]
                deliveries += self._hand_out_part(job_id, group)
                part_samples += [(job_id, t.sample_index) for t in group.samples]
            else:
                ready = self._complete.pop(job_id)
                group = ready.group
                deliveries += ready.items  # a partial group's failed samples too: committed with the step
                partials += job_id in self._partial_ids
                self._partial_ids.discard(job_id)
                self.parts.pop(job_id, None)  # its last part: the group is settled
                self._taken.add(job_id)
                self._settle(job_id)
            groups.append(group)
            # of the tokens that train: under `mask` those older than the bound do not
            staleness[min(version - oldest, self.max_staleness)] += len(group.samples)
        return Collected(
            groups=groups,
            deliveries=deliveries,
            staleness=dict(staleness),
            dropped=dict(dropped),
            partial_groups=partials,
            split_parts=len({j for j, _ in part_samples}),
            part_samples=part_samples,
            filtered_groups=len(filtered),
            filtered_rewards=[r for rewards in filtered for r in rewards],
        )


__all__ = ["Collected", "DROP_REASONS", "GroupCollector", "NothingTrains"]
