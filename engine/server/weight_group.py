"""The engine's side of SGLang's distributed weight update: join a trainer's group as rank `rank_offset` (tp_size 1),
receive broadcast tensors from rank 0. Gloo on CPU, outside torch's default process group, so one engine process can
join, drop and rejoin groups any number of times (SGLang keeps a dict of groups by name too:
model_runner_components/weight_updater.py `_model_update_group`).

Blocking calls (join, receive): the routes run them in a thread so the event loop keeps serving generation."""

from __future__ import annotations

import datetime
import logging
import threading
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import torch

# torch (and rollq.engine.weight_group, which imports it) load where a group is joined or used, not here: every engine
# serves these routes, and importing torch would double the start-up time of the engines that never use them (the
# synthetic backend's most of all).

log = logging.getLogger("rollq.engine")

DEFAULT_TIMEOUT_S = 300.0  # bounds the join and each receive when the request names no timeout_s (SGLang never does)
SUPPORTED_BACKENDS = ("gloo", "nccl")  # nccl is served by gloo: this engine's weights live on the CPU


class InitGroupRequest(msgspec.Struct, kw_only=True):
    """InitWeightsUpdateGroupReqInput (io_struct.py) + rollq's optional `timeout_s`."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    timeout_s: float | None = None


class _Group:
    __slots__ = ("store", "group", "rank", "world_size")

    def __init__(self, store: Any, group: Any, rank: int, world_size: int) -> None:
        self.store = store  # kept alive with the group
        self.group = group
        self.rank = rank
        self.world_size = world_size


class WeightGroups:
    """The groups this engine joined, by name. Thread-safe: joins and receives run in worker threads."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        with self._lock:
            return list(self._groups)

    def join(self, req: InitGroupRequest) -> tuple[bool, str]:
        """Blocks until every rank joined (or the timeout). SGLang's messages."""
        if not req.group_name:
            return False, "Failed to initialize custom process group: Group name cannot be empty."
        if req.backend not in SUPPORTED_BACKENDS:
            return False, f"Failed to initialize custom process group: backend {req.backend!r} is not supported."
        if not 0 < req.rank_offset < req.world_size:
            return False, (
                f"Failed to initialize custom process group: rank {req.rank_offset} is outside 1..{req.world_size - 1}"
            )
        if req.backend == "nccl":
            # A trainer written for SGLang asks for nccl by default; weights here are CPU tensors, so gloo it is
            # (the trainer must use gloo too: rollq's does).
            log.warning("weight update group %s: backend nccl requested, using gloo (CPU engine)", req.group_name)
        timeout_s = req.timeout_s or DEFAULT_TIMEOUT_S
        log.info(
            "init custom process group: master_address=%s, master_port=%d, rank=%d, world_size=%d, group_name=%s",
            req.master_address,
            req.master_port,
            req.rank_offset,
            req.world_size,
            req.group_name,
        )
        import torch.distributed as dist

        from rollq.engine.weight_group import gloo_group, local_address

        try:
            store = dist.TCPStore(
                req.master_address,
                req.master_port,
                req.world_size,
                is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
            host = local_address(req.master_address, req.master_port)
            group = gloo_group(store, req.rank_offset, req.world_size, req.group_name, host, timeout_s)
        except Exception as exc:
            message = f"Failed to initialize custom process group: {exc}."
            log.error(message)
            return False, message
        with self._lock:
            old = self._groups.pop(req.group_name, None)
            self._groups[req.group_name] = _Group(store, group, req.rank_offset, req.world_size)
        if old is not None:
            _abort_group(old.group)
        return True, "Succeeded to initialize custom process group."

    def destroy(self, name: str) -> tuple[bool, str]:
        with self._lock:
            entry = self._groups.pop(name, None)
        if entry is None:
            return False, "The group to be destroyed does not exist."
        _abort_group(entry.group)
        return True, "Succeeded to destroy custom process group."

    def destroy_all(self) -> None:
        for name in self.names():
            self.destroy(name)

    def receive(
        self, name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive one broadcast from rank 0: a tensor per name, in order (blocking; each op bounded by the group's
        timeout). A failure leaves the group broken: it is dropped, so the next call fails at once and the trainer
        builds a new one."""
        with self._lock:
            entry = self._groups.get(name)
            known = list(self._groups)
        if entry is None:
            raise RuntimeError(f"Group {name} not in {known}. Please call `init_weights_update_group` first.")
        import torch
        import torch.distributed as dist

        from rollq.engine.weight_group import parse_dtype

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        out: list[tuple[str, torch.Tensor]] = []
        try:
            works = []
            for n, dtype, shape in zip(names, dtypes, shapes, strict=True):
                t = torch.empty(shape, dtype=parse_dtype(dtype))
                works.append(entry.group.broadcast([t], opts))  # queued: gloo's worker threads pipeline them
                out.append((n, t))
            for work in works:
                work.wait()
        except Exception:
            with self._lock:
                if self._groups.get(name) is entry:
                    del self._groups[name]
            _abort_group(entry.group)
            raise
        return out


__all__ = ["InitGroupRequest", "WeightGroups"]


def _abort_group(group: Any) -> None:
    from rollq.engine.weight_group import abort_group

    abort_group(group)
