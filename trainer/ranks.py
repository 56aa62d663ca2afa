"""The trainer's processes: one rank per process under torchrun (`torchrun --nproc-per-node N -m rollq train`), or a
group of one when started plainly.

Rank 0 owns the queue side (admission, the ledger, consumption, pause/resume, acks); every rank holds a shard of
the model. Rank 0 tells the others what to do next over a gloo group of its own (the control group) with
msgspec-encoded commands: never pickle (torch's `broadcast_object_list` would unpickle whatever rank 0 sent), and
gloo even when the model's collectives run on NCCL, whose broadcasts need GPU tensors. The control group waits as
long as rank 0 may take to collect a step's groups; the compute group fails a collective after `dist_timeout_s`.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

# Followers wait on the control group while rank 0 collects a step's groups, which takes as long as generation
# does; a dead rank 0 is noticed at once anyway (its sockets close) and torchrun restarts the whole group.
CONTROL_WAIT = datetime.timedelta(days=1)


class RankGroup:
    """This process's place among the trainer's ranks, and the collectives the trainer uses outside FSDP's own."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0, control: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self._control = control  # the gloo group of commands and small reductions (None: a group of one)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def leader(self) -> bool:
        """Rank 0: the one that talks to Redis and the engines."""
        return self.rank == 0

    def device(self, configured: str) -> str:
        """The device of this rank: `cuda` means this rank's own GPU (LOCAL_RANK) under torchrun."""
        if self.distributed and configured == "cuda":
            return f"cuda:{self.local_rank}"
        return configured

    # -- commands: rank 0 -> every rank ----------------------------------------------------------------------------

    def announce(self, payload: bytes) -> None:
        """Rank 0: send `payload` to every other rank (they wait in `receive`)."""
        if not self.distributed:
            return
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self._control)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self._control)

    def receive(self) -> bytes:
        """Any rank but 0: the next payload rank 0 announces."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self._control)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self._control)
        return data.numpy().tobytes()

    # -- small reductions over the control group (CPU tensors whatever the backend) ---------------------------------

    def max_int(self, value: int) -> int:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._control)
        return int(t.item())

    def sum_floats(self, values: list[float]) -> list[float]:
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._control)
        return t.tolist()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by torchrun (its environment), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))


def _restart_store(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun's elastic agent the ranks share the agent's key-value store, which outlives a restart of the
    group: the new group would read the dead one's keys (its peers' addresses) and fail to connect. Each life of
    the group gets keys of its own (the restart count as prefix). None elsewhere: the environment's own rendezvous."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    shared = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"rollq/restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", shared)


def join_ranks(device: str, timeout_s: float) -> RankGroup:
    """Join the trainer's process group when torchrun started this process with more than one rank (NCCL for a GPU
    trainer, gloo on CPU; torchrun's MASTER_ADDR/MASTER_PORT rendezvous); else a group of one, with no process group
    at all (the single-process trainer stays exactly what it was)."""
    env = torchrun_env()
    if env is None or env[1] == 1:
        return RankGroup()
    rank, world_size, local_rank = env
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _restart_store(world_size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=CONTROL_WAIT)
    return RankGroup(rank, world_size, local_rank, control)


__all__ = ["RankGroup", "join_ranks", "torchrun_env"]
