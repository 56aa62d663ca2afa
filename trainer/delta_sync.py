"""Delta weight sync, the trainer's side (`delta_sync`, docs/weight-sync.md): what the engines get at each update.

The trainer keeps a CPU copy (the snapshot) of the version it published last, in the dtype the engines serve
(`sync_dtype`). At each update the new weights, cast to that dtype, are compared with it tensor by tensor
(rollq.engine.weight_delta: XOR + zstd, a checksum per tensor), and the update is a delta from the snapshot's
version (the base) unless a full one is due: no snapshot yet (the trainer's first update of its life),
`delta_full_every` updates since the last full one, or a delta of at least `delta_max_share` of the full bytes
(an fp32 engine changes nearly every weight at each step: its delta would not be smaller).

An engine gets the delta only when it reports the base version and prepares it before the pause (it, or its host
agent for an SGLang engine, rebuilds the new version beside the one it serves): a new, restarted or lagging engine,
one that answers 404 (plain SGLang: no prepare route) or 409 (not the base after all: its checksums differ) gets the
full version instead, written under weights_root only when some engine needs it.

On disk, under weights_root: `v{N}/` a full version (safetensors in sync_dtype + config.json), `d{N}/` the delta
that builds version N from the base (weight_delta.write)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollq.engine import weight_delta
from rollq.engine.client import EngineError, EngineUnavailable, SGLangClient
from rollq.engine.models import model_dir
from rollq.engine.pool import EngineMember, EnginePool
from rollq.trainer.config import TrainConfig
from rollq.trainer.policy import buckets_of, write_safetensors
from rollq.trainer.policy_protocol import TrainerPolicy

log = logging.getLogger("rollq.trainer")

MAX_SKIPPED_DELTAS = 15  # after deltas too large in a row, at most this many updates go full before the next try
PREPARE_TIMEOUT_S = 300.0  # one engine's prepare (read the delta, rebuild the version): past it, a full update
DISK_REPROBE_EVERY = 20  # updates between two asks of the engines that answered a disk prepare with 404
SYNC_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_VERSION_DIR = re.compile(r"^[vd](\d+)$")


def resolve_dtype(setting: str, engine_dtypes: list[str], model_config: Path) -> torch.dtype:
    """`sync_dtype`: the setting when it names a dtype; "auto": the dtype the engines report (the most common one),
    else the model config's (`torch_dtype`, or `dtype` in newer transformers), else float32."""
    if setting != "auto":
        return SYNC_DTYPES[setting]
    known = [d.removeprefix("torch.") for d in engine_dtypes if d.removeprefix("torch.") in SYNC_DTYPES]
    if known:
        chosen = max(set(known), key=known.count)
        if len(set(known)) > 1:
            log.warning("engines serve different dtypes %s: weights are sent in %s", sorted(set(known)), chosen)
        return SYNC_DTYPES[chosen]
    try:
        config = json.loads(model_config.read_text())
    except (OSError, ValueError):
        config = {}
    named = str(config.get("torch_dtype") or config.get("dtype") or "")
    return SYNC_DTYPES.get(named, torch.float32)


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass
class Update:
    """One update's plan, before the pause."""

    version: str
    new: dict[str, torch.Tensor]  # the new weights in the sync dtype (the snapshot once published)
    full_bytes: int  # what a full update sends to one engine
    delta: weight_delta.WeightDelta | None = None  # None: the full version for every engine
    share: float = 0.0  # the delta's bytes / the full bytes (taken even when too large to send: it says why)
    why_full: str = ""  # why every engine gets the full version ("" when a delta goes out)
    # engine URL -> what it swaps in: its prepared delta, or the full version its host agent copied beside it
    loads: dict[str, str] = field(default_factory=dict)
    delta_bytes: dict[str, int] = field(default_factory=dict)  # engine URL -> delta bytes it read or received
    reconciled: list[str] = field(default_factory=list)  # stale engines given the base version in full first
    prepare_s: float = 0.0

    @property
    def base(self) -> str:
        return self.delta.manifest.base_version if self.delta is not None else ""

    def phases(self, ok: list[str], full: list[str]) -> dict[str, float]:
        """The update's phase keys beside the cycle's: bytes each updated engine read or received, summed, and
        how many engines got the full weights (`full`: given them in the cycle; `ok`: loaded the new version; a
        stale engine reconciled first got the base version in full, then the delta)."""
        delta_engines = [url for url in ok if url in self.delta_bytes and url not in full]
        sent = sum(self.delta_bytes[url] if url in delta_engines else self.full_bytes for url in ok)
        sent += self.full_bytes * len(self.reconciled)
        given_full = {url for url in ok if url not in delta_engines} | set(self.reconciled)
        return {
            "prepare_s": self.prepare_s,
            "bytes_sent": float(sent),
            "bytes_per_engine": sent / len(ok) if ok else 0.0,
            "delta": 1.0 if delta_engines else 0.0,
            "full_engines": float(len(given_full)),
            "delta_share": self.share,
        }


class DeltaSync:
    """The snapshot, the decision and the files of delta sync (one per trainer; the trainer runs on rank 0)."""

    def __init__(self, config: TrainConfig, pool: EnginePool, weights_root: Path) -> None:
        self.cfg = config
        self.pool = pool
        self.weights_root = weights_root
        self.bucket_bytes = int(config.publish_bucket_mb * (1 << 20))
        self.dtype: torch.dtype | None = None
        self.snapshot: dict[str, torch.Tensor] | None = None
        self.snapshot_version: str | None = None  # the base of the next delta: what the engines were last sent
        self.last_full: int | None = None  # the version of the last update that sent no delta
        self.pending: Update | None = None  # the update under way: its full version is written from it on demand
        self.cannot_prepare: set[str] = set()  # engines that answered 404 to a distributed prepare
        # Who answered 404 to a disk prepare (the engine's URL, or its agent's): plain SGLang without an agent, an
        # engine holding no weights. Asked again only every DISK_REPROBE_EVERY updates (an agent may come up later)
        self.no_disk_prepare: set[str] = set()
        self._written: set[str] = set()  # full versions this trainer wrote (an older life's files are rewritten)
        self._write_lock = asyncio.Lock()
        self._agents: dict[str, SGLangClient] = {}
        self._said_full = ""
        # Deltas in a row that were too large (an fp32 engine: nearly every weight changes), and the updates left
        # before the next try: encoding one costs seconds on a large model, for nothing while they stay too large
        self._too_large = 0
        self._skip = 0
        self._last_share = 0.0
        self.deltas_taken = 0  # deltas encoded (sent or found too large)

    # -- the new weights -------------------------------------------------------------------------------------------

    async def resolve_dtype(self) -> torch.dtype:
        if self.dtype is None:
            dtypes: list[str] = []
            if self.cfg.sync_dtype == "auto":
                infos = await asyncio.gather(
                    *(m.client.server_info() for m in self.pool.engines()), return_exceptions=True
                )
                dtypes = [str(i["dtype"]) for i in infos if isinstance(i, dict) and i.get("dtype")]
            self.dtype = resolve_dtype(self.cfg.sync_dtype, dtypes, model_dir(self.cfg.model) / "config.json")
            log.info("delta sync: weights go to the engines in %s", str(self.dtype).removeprefix("torch."))
        return self.dtype

    async def gather(self, policy: TrainerPolicy) -> dict[str, torch.Tensor]:
        """The policy's full weights (gathered from every rank's shards), each cast to the sync dtype as a copy of
        its own: the snapshot must not follow the live parameters."""
        dtype = await self.resolve_dtype()

        def collect() -> dict[str, torch.Tensor]:
            out: dict[str, torch.Tensor] = {}
            buckets = policy.gather_weights(self.bucket_bytes)
            try:
                for bucket in buckets:
                    for name, t in bucket:
                        out[name] = t.detach().to("cpu").to(dtype, copy=True).contiguous()
            finally:
                close = getattr(buckets, "close", None)
                if close is not None:
                    close()
            return out

        return await asyncio.to_thread(collect)

    async def decide(self, version: int, new: dict[str, torch.Tensor], *, no_delta: str = "") -> Update:
        """A delta from the snapshot, or why every engine gets the full version (`no_delta`: the caller knows
        already, and no delta is taken)."""
        update = Update(version=str(version), new=new, full_bytes=tensor_bytes(new))
        self.pending = update
        every = self.cfg.delta_full_every
        if no_delta:
            update.why_full = no_delta
        elif self.snapshot is None or self.snapshot_version is None:
            update.why_full = "no earlier version to take a delta from"
        elif every and self.last_full is not None and version - self.last_full >= every:
            update.why_full = f"a full update every {every} (delta_full_every)"
        elif self._skip:
            self._skip -= 1
            update.share = self._last_share
            update.why_full = f"the last {self._too_large} deltas were too large: the next is taken in {self._skip + 1}"
        else:
            base, base_version = self.snapshot, self.snapshot_version
            try:
                delta = await asyncio.to_thread(
                    weight_delta.encode, base, new, base_version=base_version, version=str(version)
                )
            except ValueError as exc:  # other names, shapes or dtype than the snapshot's
                update.why_full = f"the weights do not compare with version {base_version}'s: {exc}"
                return update
            self.deltas_taken += 1
            update.share = self._last_share = delta.manifest.share
            if update.share >= self.cfg.delta_max_share:
                update.why_full = (
                    f"the delta is {update.share:.1%} of the full weights (delta_max_share {self.cfg.delta_max_share})"
                )
                self._too_large += 1
                self._skip = min(2**self._too_large - 1, MAX_SKIPPED_DELTAS)  # 1, 3, 7, 15, 15...
            else:
                update.delta = delta
                self._too_large = 0
        if update.why_full and update.why_full != self._said_full:
            log.info("weights %s: a full update (%s)", version, update.why_full)
        self._said_full = update.why_full  # said again only when the reason changes
        return update

    def commit(self, update: Update, *, delta_sent: bool) -> None:
        """`update` is published: its weights are the base of the next delta."""
        self.snapshot, self.snapshot_version = update.new, update.version
        if not delta_sent:
            self.last_full = int(update.version)
        self.pending = None

    def checksums(self) -> dict[str, str]:
        """The snapshot's checksums by name (an engine's /rollq/weights_checksum must match them)."""
        return {name: weight_delta.checksum(t) for name, t in (self.snapshot or {}).items()}

    # -- files -----------------------------------------------------------------------------------------------------

    def full_dir(self, version: str | int) -> Path:
        return self.weights_root / f"v{version}"

    def delta_dir(self, version: str | int) -> Path:
        return self.weights_root / f"d{version}"

    async def write_delta(self, update: Update) -> Path:
        assert update.delta is not None
        return await asyncio.to_thread(weight_delta.write, self.delta_dir(update.version), update.delta)

    async def ensure_full(self, version: str) -> str:
        """The full version `version` on disk (the update under way's, or the snapshot's), written now if this
        trainer has not written it yet."""
        async with self._write_lock:
            path = self.full_dir(version)
            if version in self._written:
                return str(path)
            if self.pending is not None and self.pending.version == version:
                tensors = self.pending.new
            elif self.snapshot is not None and self.snapshot_version == version:
                tensors = self.snapshot
            else:
                raise RuntimeError(f"weights of version {version} are not held any more")
            config = model_dir(self.cfg.model) / "config.json"

            def write_config(folder: Path) -> None:
                if config.is_file():
                    shutil.copyfile(config, folder / "config.json")

            items = buckets_of(iter(tensors.items()), self.bucket_bytes)
            await asyncio.to_thread(write_safetensors, path, items, write_config)
            self._written.add(version)
            return str(path)

    async def prune(self, version: int, keep: int) -> None:
        """Versions (full and delta) older than the last `keep` go: an engine being reconciled may still read the
        one before this."""
        if not self.weights_root.is_dir():
            return
        for old in self.weights_root.iterdir():
            m = _VERSION_DIR.match(old.name)
            if m and int(m.group(1)) <= version - keep:
                self._written.discard(m.group(1))
                await asyncio.to_thread(shutil.rmtree, old, True)

    # -- the engines -----------------------------------------------------------------------------------------------

    async def versions(self, members: list[EngineMember]) -> dict[str, str | None]:
        """The weight version each engine reports now (None: it did not answer). Asked, not remembered: an engine
        restarted since the last update reports what it loaded at start."""
        got = await asyncio.gather(*(m.client.weight_version() for m in members), return_exceptions=True)
        return {m.url: v if isinstance(v, str) else None for m, v in zip(members, got, strict=True)}

    def _preparer(self, member: EngineMember) -> SGLangClient:
        """Who prepares the delta for an engine: its host agent when it has one, else the engine itself."""
        if not member.agent_url:
            return member.client
        client = self._agents.get(member.agent_url)
        if client is None:
            config = self.pool.config
            client = SGLangClient(
                member.agent_url, member.client.http, api_key=config.api_key, admin_api_key=config.admin_api_key
            )
            self._agents[member.agent_url] = client
        return client

    def preparer_url(self, member: EngineMember) -> str:
        return member.agent_url or member.url

    def takes_disk_deltas(self, members: list[EngineMember], version: int) -> list[EngineMember]:
        """The engines that may take a delta over disk: all but those whose preparer answered 404 lately (every
        DISK_REPROBE_EVERY updates all of them are asked again). When none may, no delta is even taken."""
        if version % DISK_REPROBE_EVERY == 0:
            self.no_disk_prepare.clear()
        return [m for m in members if self.preparer_url(m) not in self.no_disk_prepare]

    async def prepare_disk(self, update: Update, members: list[EngineMember]) -> None:
        """Before the pause: every engine on the delta's base prepares the delta (`update.loads` gets what it will
        swap in); every other engine, and any that cannot prepare it, will load the full version."""
        delta = update.delta
        assert delta is not None
        path = str(await self.write_delta(update))
        members = [m for m in members if self.preparer_url(m) not in self.no_disk_prepare]
        versions = await self.versions(members)
        on_base = [m for m in members if versions[m.url] == update.base]
        for m in members:
            if m not in on_base:
                held = versions[m.url]
                log.info("engine %s holds version %s, not %s: it gets the full weights", m.url, held, update.base)

        async def prepare(member: EngineMember) -> None:
            client = self._preparer(member)
            try:
                reply = await client.prepare_weights(update.version, model_path=path, timeout=PREPARE_TIMEOUT_S)
            except EngineError as exc:
                if exc.status == 404:  # plain SGLang without a host agent: it loads full versions
                    self.no_disk_prepare.add(self.preparer_url(member))
                    log.info("engine %s cannot prepare deltas (%s): it gets full updates", member.url, exc)
                else:
                    log.info("engine %s did not take delta %s (%s): it gets the full weights", member.url, path, exc)
                return
            except EngineUnavailable as exc:
                log.warning("engine %s: prepare failed (%s): it gets the full weights", member.url, exc)
                return
            update.loads[member.url] = str(reply.get("load_path") or path)
            update.delta_bytes[member.url] = int(reply.get("bytes_read") or delta.manifest.blob_bytes)

        await asyncio.gather(*(prepare(m) for m in on_base))

    async def prepare_full_on_agents(self, update: Update, members: list[EngineMember]) -> None:
        """Engines with a host agent that get the full version this time: their agent takes it first (before the
        pause: it copies it beside the engine and builds the next deltas on it), and the engine swaps in the agent's
        copy. Without this the agent would not know what its engine holds, and refuse the next delta."""
        needing = [
            m
            for m in members
            if m.agent_url and m.url not in update.loads and self.preparer_url(m) not in self.no_disk_prepare
        ]
        if not needing:
            return
        path = await self.ensure_full(update.version)

        async def prepare(member: EngineMember) -> None:
            try:
                reply = await self._preparer(member).prepare_weights(
                    update.version, model_path=path, timeout=PREPARE_TIMEOUT_S
                )
            except (EngineError, EngineUnavailable) as exc:  # the engine loads the trainer's copy itself
                log.warning("engine %s: its agent did not take version %s (%s)", member.url, update.version, exc)
                if isinstance(exc, EngineError) and exc.status == 404:  # no agent there: not asked again for a while
                    self.no_disk_prepare.add(self.preparer_url(member))
                return
            update.loads[member.url] = str(reply.get("load_path") or path)

        await asyncio.gather(*(prepare(m) for m in needing))

    async def prepare_distributed(self, update: Update, members: list[EngineMember], sync: Any) -> list[EngineMember]:
        """Before the pause, over the weight update group: the delta goes only when every engine is on its base and
        can prepare it (one broadcast reaches the whole group); returns the engines that staged it (all or none)."""
        assert update.delta is not None
        if not members:
            return []
        versions = await self.versions(members)
        off_base = {m.url: versions[m.url] for m in members if versions[m.url] != update.base}
        if off_base:
            log.info(
                "weights %s: a full broadcast to every engine (off the base %s: %s)",
                update.version,
                update.base,
                off_base,
            )
            return []
        manifest, blob = update.delta
        answers = await sync.prepare_delta(manifest, blob, update.version, members)
        for url, answer in answers.items():
            if isinstance(answer, EngineError) and answer.status == 404:
                self.cannot_prepare.add(url)  # an SGLang engine: never asked again (a failed prepare costs a group)
        failed = {url: str(a) for url, a in answers.items() if isinstance(a, BaseException)}
        if failed:
            log.info("weights %s: a full broadcast to every engine (prepare failed: %s)", update.version, failed)
            return []
        for m in members:
            update.loads[m.url] = ""
            update.delta_bytes[m.url] = manifest.blob_bytes
        return list(members)


__all__ = ["DeltaSync", "Update", "resolve_dtype", "tensor_bytes"]
