"""The engines' probes keep a paused engine alive and in its Service.

A weight update pauses every engine (pause -> load -> resume, the trainer's cycle). On the reference engine and on
SGLang, /health runs a one-token generation that waits at the pause gate (503 after health_timeout) and /ready is
503 while paused; so the manifests probe liveness and readiness on /metrics and keep /health for the startup probe.
Here a real reference engine, started from the cpu overlay's StatefulSet exactly as rendered (command, environment,
volumes), is paused through its admin route and given new weights from the shared volume, as the trainer does; the
probes the manifest names (route, port, timeout: read from the rendered objects) are run as the kubelet runs them
before, during and after the update, while it stays paused. Each answers within its timeout, so no failure
accumulates towards failureThreshold however long the pause lasts; the startup probe, whose route does block, allows
the longest pause the StatefulSet documents (rollq.dev/max-pause-seconds)."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import pytest

from rollq.cli import parse
from rollq.engine.client import SGLangClient
from rollq.engine.models import model_dir
from rollq.trainer.config import TrainConfig
from tests.deploy.kubernetes import KubeStack, by_kind, named_port, pod_spec

pytestmark = pytest.mark.timeout(120)

MAX_PAUSE = "rollq.dev/max-pause-seconds"


def engine_probes(objects) -> tuple[Mapping[str, Any], Mapping[str, Any], dict[str, Mapping[str, Any]]]:
    engine = by_kind(objects, "StatefulSet")["engine"]
    container = pod_spec(engine)["containers"][0]
    probes = {k: container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    return engine, container, probes


async def kubelet_probe(http: aiohttp.ClientSession, base: str, container, probe: Mapping[str, Any]) -> bool:
    """One attempt as the kubelet makes it: GET, success on 200-399 within timeoutSeconds."""
    get = probe["httpGet"]
    assert named_port(container, get["port"]) == 30000
    try:
        timeout = aiohttp.ClientTimeout(total=probe.get("timeoutSeconds", 1))
        async with http.get(base + get["path"], timeout=timeout) as r:
            return 200 <= r.status < 400
    except (TimeoutError, aiohttp.ClientError):
        return False


async def test_probes_pass_on_an_engine_paused_mid_update(kube, tmp_path):
    secrets, rendered = kube
    objects = rendered["cpu"]
    engine, container, probes = engine_probes(objects)
    stack = KubeStack(objects, tmp_path, only=["redis", "engine"])
    try:
        for name in ("redis", "engine"):
            stack.start(name)
            await asyncio.to_thread(stack.wait_healthy, name, 90.0)
        replica = stack.replicas["engine"][0]
        base = f"http://127.0.0.1:{replica.ports[30000]}"
        config = parse(stack.command(replica)[1:], env=stack.environment(replica)).settings[0]
        # the next policy, where the trainer writes it: the shared weights volume, under the engines' weights_root
        policy = stack.volumes["weights"] / "toy" / "v1"
        shutil.copytree(model_dir("tiny"), policy)
        async with aiohttp.ClientSession() as http:
            client = SGLangClient(
                base,
                http,
                api_key=secrets.values["ROLLQ_ENGINE_API_KEY"],
                admin_api_key=secrets.values["ROLLQ_ENGINE_ADMIN_API_KEY"],
            )
            running = {kind: await kubelet_probe(http, base, container, p) for kind, p in probes.items()}
            assert running == dict.fromkeys(probes, True), "every probe passes on a running engine"

            await client.pause_generation(TrainConfig().pause_mode)  # the trainer's pause
            failures = dict.fromkeys(("livenessProbe", "readinessProbe"), 0)

            async def probe_round() -> None:
                for kind in failures:
                    ok = await kubelet_probe(http, base, container, probes[kind])
                    failures[kind] += not ok

            await probe_round()  # paused, before the load
            update = asyncio.create_task(client.update_weights_from_disk(str(policy), weight_version="1"))
            await probe_round()  # paused, the update in flight
            reply = await update
            assert reply["success"], reply
            await probe_round()  # paused, loaded, not yet resumed
            # really paused: /ready says so and /health waits at the pause gate (the routes the probes avoid)
            async with http.get(base + "/ready") as r:
                assert r.status == 503
            blocked = time.monotonic()
            with pytest.raises(TimeoutError):
                async with http.get(base + "/health", timeout=aiohttp.ClientTimeout(total=1.0)):
                    pass
            assert time.monotonic() - blocked >= 0.9
            assert failures == {"livenessProbe": 0, "readinessProbe": 0}, failures
            await client.continue_generation()
            assert await client.weight_version() == "1", "the update loaded the new policy"
            resumed = {kind: await kubelet_probe(http, base, container, p) for kind, p in probes.items()}
            assert resumed == dict.fromkeys(probes, True)
    finally:
        stack.close()

    # the startup probe's route blocks while paused (shown above): its budget covers the documented longest pause,
    # and each attempt outwaits the engine's health timeout (a paused engine answers 503 rather than timing out)
    startup = probes["startupProbe"]
    max_pause = float(engine["metadata"]["annotations"][MAX_PAUSE])
    assert startup["failureThreshold"] * startup["periodSeconds"] >= max_pause
    assert startup["timeoutSeconds"] > config.health_timeout
    for kind in ("livenessProbe", "readinessProbe"):
        assert probes[kind]["httpGet"]["path"] not in ("/health", "/health_generate", "/ready"), kind


# SGLang's routes that need no key (docs/sglang-protocol.md: utils/auth.py) and which of them wait at the pause gate
SGLANG_OPEN = {"/health", "/health_generate", "/ready", "/metrics"}
SGLANG_BLOCKED_WHILE_PAUSED = {"/health", "/health_generate", "/ready"}
SGLANG_HEALTH_TIMEOUT_S = 20  # SGLANG_HEALTH_CHECK_TIMEOUT


def test_sglang_probes_avoid_the_routes_a_pause_blocks(kube):
    """overlays/gpu: SGLang cannot run here; its probes are held to its documented routes: liveness and readiness
    on /metrics (served with --enable-metrics, open, never at the pause gate), startup on /health_generate with a
    budget covering the documented longest pause."""
    _, rendered = kube
    engine, container, probes = engine_probes(rendered["gpu"])
    assert container["image"].startswith("lmsysorg/sglang:")
    for kind, probe in probes.items():
        assert probe["httpGet"]["path"] in SGLANG_OPEN, kind
    for kind in ("livenessProbe", "readinessProbe"):
        assert probes[kind]["httpGet"]["path"] not in SGLANG_BLOCKED_WHILE_PAUSED, kind
    if any(p["httpGet"]["path"] == "/metrics" for p in probes.values()):
        assert "--enable-metrics" in container["args"]
    startup = probes["startupProbe"]
    assert startup["httpGet"]["path"] == "/health_generate"
    assert startup["failureThreshold"] * startup["periodSeconds"] >= float(engine["metadata"]["annotations"][MAX_PAUSE])
    assert startup["timeoutSeconds"] > SGLANG_HEALTH_TIMEOUT_S
