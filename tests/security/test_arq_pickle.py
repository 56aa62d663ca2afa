"""Nothing read from Redis is unpickled (issue 24, F1): remote rewards' arq jobs and results travel as msgpack.

A pickle planted in `arq:job:<id>` (plus its entry in the run's reward queue) is refused by a real
`rollq reward-worker`: nothing runs, the job leaves the queue and is dead-lettered to the run's `:dead` stream with a
readable error. A pickle planted in `arq:result:<id>` of a pending call is refused by the rollout side's
RemoteReward: nothing runs, the call fails with a RewardError that says so."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import datetime
import enum
import logging
import os
import pickle
import re
import time
import uuid
from collections import Counter
from pathlib import Path

import msgspec
import numpy
import pytest
from arq.constants import in_progress_key_prefix, job_key_prefix, result_key_prefix, retry_key_prefix
from arq.jobs import (
    DeserializationError,
    SerializationError,
    deserialize_job_raw,
    deserialize_result,
    serialize_job,
    serialize_result,
)

from rollq.producer.status import gather_status
from rollq.protocol.arrays import Int32Array
from rollq.protocol.codec import Codec
from rollq.protocol.keys import PAYLOAD_FIELD, RunKeys
from rollq.redis_client import redis_client
from rollq.workers.rewards import arq_codec
from rollq.workers.rewards.config import RewardWorkerConfig
from rollq.workers.rewards.processes import RewardError
from rollq.workers.rewards.remote import RemoteReward
from rollq.workers.rewards.worker import RefusedJobs, worker_settings
from tests.helpers import REPO_ROOT
from tests.workers.test_remote_rewards import reward_worker

WAIT_S = 15.0
enc = arq_codec.encode


class Planted:
    """Unpickling this runs a shell command that creates `marker` (what an attacker's payload would do)."""

    def __init__(self, marker: Path, pad: int = 0) -> None:
        self.command = f"touch {marker} #{'x' * pad}"  # pad: a payload longer than what a dead letter keeps

    def __reduce__(self):
        return (os.system, (self.command,))


def planted_pickle(marker: Path, pad: int = 0) -> bytes:
    payload = pickle.dumps(Planted(marker, pad))
    assert payload[:1] == b"\x80"  # a real pickle (protocol 2+), never loaded here
    return payload


async def test_planted_jobs_are_refused_unrun_and_dead_lettered(redis_url, run_name, redis, tmp_path):
    marker = tmp_path / "PWNED-worker"
    pickled = planted_pickle(marker, pad=5000)
    planted = {  # job id -> (payload, what the dead letter says after "arq job <id>: ")
        f"pickle-{uuid.uuid4().hex[:8]}": (pickled, "payload is not msgpack (it starts like a pickle): refused"),
        f"list-{uuid.uuid4().hex[:8]}": (
            msgspec.msgpack.encode([1, 2]),
            "payload is msgpack but a list, not an arq record (a map): refused",
        ),
        f"map-{uuid.uuid4().hex[:8]}": (
            msgspec.msgpack.encode({"x": 1}),
            "payload is not an arq job (KeyError: 'f'): refused",
        ),
    }
    keys = RunKeys(run_name)
    log = tmp_path / "w.log"
    with reward_worker(redis_url, run_name, log) as proc:
        for job_id, (payload, _) in planted.items():
            await redis.set(job_key_prefix + job_id, payload)
            await redis.zadd(keys.rewards, {job_id: int(time.time() * 1000)})
        deadline = time.monotonic() + WAIT_S
        # arq writes a job's (failed) result once it is done with it: the end of its handling, whatever happened.
        while await redis.exists(*(result_key_prefix + j for j in planted)) < len(planted):  # bounded poll
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            await asyncio.sleep(0.02)
        assert not marker.exists(), "the planted pickle ran on the reward worker"
        # Not retried, not left in progress: off the queue, their keys gone.
        assert await redis.zcard(keys.rewards) == 0
        for job_id in planted:
            for prefix in (job_key_prefix, in_progress_key_prefix, retry_key_prefix):
                assert not await redis.exists(prefix + job_id), prefix + job_id
        # Dead-lettered where `rollq status` counts them, with a readable error and the payload's start.
        letters = {}
        for _, fields in await redis.xrange(keys.dead):
            letter = Codec().decode_dead_letter(fields[PAYLOAD_FIELD])
            letters[letter.entry_id.removeprefix("arq:job:")] = letter
        assert letters.keys() == planted.keys()
        for job_id, (payload, why) in planted.items():
            assert letters[job_id].error.type == "RefusedArqPayload"
            assert letters[job_id].error.message == f"arq job {job_id}: {why}"
            assert letters[job_id].raw == payload[:4096]
            assert f"arq job {job_id}: {why}; dead-lettered to {keys.dead}" in log.read_text()
        status = await gather_status(redis, run_name)
        assert status.dead_letters == len(planted)
        assert {d.error_type for d in status.recent_dead_letters} == {"RefusedArqPayload"}
        assert proc.poll() is None  # the reward worker keeps serving
        async with RemoteReward("tests.reward_fns:exact_match", redis_url=redis_url, run=run_name) as rr:
            assert await rr("42") == 1.0
    assert not marker.exists()


async def test_a_planted_pickle_result_is_refused_by_the_caller(redis_url, run_name, redis, tmp_path):
    marker = tmp_path / "PWNED-caller"
    keys = RunKeys(run_name)

    async def plant_result() -> str:
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while not (queued := await redis.zrange(keys.rewards, 0, -1)):  # bounded poll: no event to await
            assert asyncio.get_running_loop().time() < deadline, "the call was never enqueued"
            await asyncio.sleep(0.01)
        job_id = queued[0].decode()
        await redis.set(result_key_prefix + job_id, planted_pickle(marker))
        return job_id

    # No reward worker: the "result" comes from whoever can write arq:result:* (the pickup window stays open).
    async with RemoteReward(
        "tests.reward_fns:exact_match", redis_url=redis_url, run=run_name, pickup_timeout_seconds=WAIT_S
    ) as rr:
        planter = asyncio.create_task(plant_result())
        with pytest.raises(
            RewardError, match=r"unreadable result: payload is not msgpack \(it starts like a pickle\): refused"
        ) as info:
            await asyncio.wait_for(rr("42"), WAIT_S)
        job_id = await planter
    assert job_id in str(info.value)
    assert not marker.exists(), "the planted pickle ran in the rollout worker"
    assert not await redis.exists(result_key_prefix + job_id)  # not left for another reader


# -- the codec itself, through arq's own record functions --------------------------------------------------------


def test_what_remote_rewards_send_round_trips_as_msgpack():
    ids = Int32Array([5, 6, 7])
    args = ("tests.reward_fns:completion_reward", ["prompt", "completion", [1, 2, 3], [4, 5]], {})
    kwargs = {"bonus": 0.5, "meta": {"nested": [1, None, 2.5, True, b"\x00\xff"], 3: "int key"}, "ids": ids}
    raw = serialize_job("compute_reward", args, kwargs, None, 1234, serializer=arq_codec.encode)
    assert raw[:1] != arq_codec.PICKLE_START
    function, got_args, got_kwargs, job_try, enqueued = deserialize_job_raw(raw, deserializer=arq_codec.decode)
    assert (function, job_try, enqueued) == ("compute_reward", None, 1234)
    assert got_args == list(args)  # the one change: tuples arrive as lists
    assert got_kwargs == kwargs and type(got_kwargs["ids"]) is Int32Array
    assert type(got_kwargs["bonus"]) is float and got_kwargs["meta"]["nested"][4] == b"\x00\xff"

    for value in ({"ok": 0.75}, {"error": "RewardTimeout", "message": "took longer than 1s", "traceback": ""}):
        raw = serialize_result("compute_reward", (), {}, 1, 1, True, value, 2, 3, "ref", "q", "id", serializer=enc)
        assert deserialize_result(raw, deserializer=arq_codec.decode).result == value


def test_arq_failures_travel_as_readable_exception_records():
    from arq.worker import JobExecutionFailed

    failure = serialize_result(
        "compute_reward",
        (),
        {},
        4,
        1,
        False,
        JobExecutionFailed("max 3 retries exceeded"),
        2,
        3,
        "r",
        "q",
        "id",
        serializer=enc,
    )
    info = deserialize_result(failure, deserializer=arq_codec.decode)
    assert not info.success
    assert arq_codec.describe_failure(info.result) == "JobExecutionFailed: max 3 retries exceeded"
    try:
        raise DeserializationError("unable to deserialize job") from arq_codec.RefusedPayload("not msgpack: refused")
    except DeserializationError as exc:
        record = arq_codec.exception_record(exc)
    assert record == {
        "exception": "DeserializationError",
        "message": "unable to deserialize job: RefusedPayload: not msgpack: refused",
    }


class Color(enum.IntEnum):
    RED = 1


@dataclasses.dataclass
class Point:
    x: int


def _cycle() -> list:
    items: list = []
    items.append(items)
    return items


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"when": datetime.datetime(2024, 1, 1)}, r"kwargs\['when'\] is datetime.datetime, not plain data"),
        ({"p": Point(1)}, r"kwargs\['p'\] is .*Point, not plain data"),
        ({"c": Color.RED}, r"kwargs\['c'\] is .*Color, not plain data"),
        ({"s": {1, 2}}, r"kwargs\['s'\] is set, not plain data"),
        ({"x": [1, [2, numpy.float64(0.5)]]}, r"kwargs\['x'\]\[1\]\[1\] is numpy.float64, not plain data"),
        ({"d": {1.5: "float key"}}, r"kwargs\['d'\]: key 1.5 is float"),
        ({"big": 2**70}, r"can't serialize ints"),
        ({"loop": _cycle()}, r"nested deeper than 64 levels"),
    ],
)
def test_anything_but_plain_data_is_refused_naming_where(kwargs, message):
    with pytest.raises(arq_codec.NotPlainData) as info:
        arq_codec.encode({"f": "compute_reward", "a": [], "k": kwargs})
    assert re.search(message, str(info.value)), str(info.value)
    with pytest.raises(SerializationError) as wrapped:  # what arq makes of it
        serialize_job("compute_reward", (), kwargs, None, 1, serializer=arq_codec.encode)
    assert isinstance(wrapped.value.__cause__, arq_codec.NotPlainData)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (pickle.dumps({"f": "compute_reward"}), r"payload is not msgpack \(it starts like a pickle\): refused"),
        (b"\xc1", r"payload is not msgpack \(.*\): refused"),
        (msgspec.msgpack.encode([1, 2]), r"payload is msgpack but a list, not an arq record \(a map\): refused"),
        (msgspec.msgpack.encode({"x": msgspec.msgpack.Ext(9, b"?")}), r"unknown msgpack extension code 9"),
        (b"\x91" * 100_000 + b"\xc0", r"payload is msgpack nested too deeply to decode: refused"),
    ],
)
def test_a_payload_that_is_not_a_msgpack_map_is_refused_unread(payload, message):
    with pytest.raises(arq_codec.RefusedPayload, match=message):
        arq_codec.decode(payload)


# -- every arq pool and worker in the code uses the codec ---------------------------------------------------------

SCANNED = ("bench", "engine", "producer", "protocol", "rollq", "trainer", "workers")
NEEDS = {  # arq's constructors and record functions -> the keywords that replace its pickle default
    "create_pool": ("job_serializer", "job_deserializer"),
    "ArqRedis": ("job_serializer", "job_deserializer"),
    "Worker": ("job_serializer", "job_deserializer"),
    "create_worker": ("job_serializer", "job_deserializer"),
    "run_worker": ("job_serializer", "job_deserializer"),
    "serialize_job": ("serializer",),
    "serialize_result": ("serializer",),
    "deserialize_job": ("deserializer",),
    "deserialize_job_raw": ("deserializer",),
    "deserialize_result": ("deserializer",),
    "Job": ("_deserializer",),
}
SPLATS = {"worker_settings"}  # `**worker_settings(...)`: test_the_reward_worker_settings_carry_the_codec checks it


def arq_uses(path: Path, root: Path = REPO_ROOT) -> tuple[list[str], list[str]]:
    """(what arq constructions `path` has, which of them keep arq's pickle default)."""
    tree = ast.parse(path.read_text(), str(path))
    names: dict[str, str] = {}  # local name -> arq name
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "arq":
            names.update({a.asname or a.name: a.name for a in node.names if a.name in NEEDS})
    for node in ast.walk(tree):  # subclasses of arq's classes construct them too
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                if isinstance(base, ast.Name) and base.id in names:
                    names[node.name] = names[base.id]
    found: list[str] = []
    bad: list[str] = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call):
            callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if callee not in names:
                continue
            found.append(f"{where} {callee}")
            given = {k.arg for k in node.keywords if k.arg}
            splat = any(
                k.arg is None and isinstance(k.value, ast.Call) and getattr(k.value.func, "id", "") in SPLATS
                for k in node.keywords
            )
            if not splat and not set(NEEDS[names[callee]]) <= given:
                bad.append(f"{where} {callee}(...) without {', '.join(NEEDS[names[callee]])}")
        elif isinstance(node, ast.ClassDef):  # `python -m arq module.WorkerSettings`
            attrs = {t.id for s in node.body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Name)}
            if {"functions", "redis_settings"} <= attrs:
                found.append(f"{where} class {node.name}")
                if not {"job_serializer", "job_deserializer"} <= attrs:
                    bad.append(f"{where} arq settings class {node.name} without job_serializer, job_deserializer")
    return found, bad


def test_every_arq_pool_and_worker_in_the_code_uses_msgpack():
    found: list[str] = []
    bad: list[str] = []
    for top in SCANNED:
        for path in sorted((REPO_ROOT / top).rglob("*.py")):
            if re.search(r"\bfrom arq\b|\bimport arq\b", path.read_text()):
                f, b = arq_uses(path)
                found += f
                bad += b
    assert not bad, "\n".join(bad)
    seen = " ".join(found)
    for expected in (
        "workers/rewards/remote.py:",
        "RewardQueueWorker",
        "class WorkerSettings",
        "bench/queue_throughput.py:",
        "deserialize_result",
    ):
        assert expected in seen, f"the scan no longer sees {expected!r}: {found}"


def test_the_scan_sees_arqs_pickle_default(tmp_path):
    source = tmp_path / "uses_arq.py"
    source.write_text(
        "from arq.connections import create_pool as make\n"
        "from arq.jobs import deserialize_result\n"
        "from arq.worker import Worker\n"
        "class Mine(Worker): ...\n"
        "class Settings:\n"
        "    functions = []\n"
        "    redis_settings = None\n"
        "async def f(s, raw):\n"
        "    await make(s, job_serializer=len, job_deserializer=len)\n"  # fine
        "    await make(s, job_serializer=len)\n"
        "    deserialize_result(raw)\n"
        "    Mine(functions=[])\n"
    )
    found, bad = arq_uses(source, tmp_path)
    assert len(found) == 5
    assert {b.split()[0] for b in bad} == {"uses_arq.py:5", "uses_arq.py:10", "uses_arq.py:11", "uses_arq.py:12"}


def test_the_reward_worker_settings_carry_the_codec():
    settings = worker_settings(RewardWorkerConfig(run="codec-check"))
    assert settings["job_serializer"] is arq_codec.encode and settings["job_deserializer"] is arq_codec.decode


async def test_a_refusal_that_cannot_be_dead_lettered_is_still_logged_and_counted(unused_redis_url, caplog):
    """The run's Redis unreachable (or its ACL user lacking XADD on the dead stream): refused all the same."""
    outcomes: Counter[str] = Counter()
    refused = RefusedJobs(redis_client(unused_redis_url, retries=0), "nodead", outcomes)
    try:
        with caplog.at_level(logging.ERROR, logger="rollq.rewards"):
            await refused.dead_letter(
                "j1", b"\x80\x04junk", "payload is not msgpack (it starts like a pickle): refused"
            )
    finally:
        await refused.redis.aclose()
    assert outcomes == {"RefusedArqPayload": 1}
    assert "arq job j1: payload is not msgpack (it starts like a pickle): refused (not dead-lettered: " in caplog.text
