"""`rollq keda`: the KEDA objects that scale the `worker` Deployment on a run's queue, printed as YAML
(deploy/kubernetes/components/keda/keda.yaml is this command's output for the defaults; docs/keda.md).

What the scaler reads, from KEDA v2.20.2's pkg/scalers/redis_streams_scaler.go (no code of it here):
- a trigger with `consumerGroup` and a non-zero `lagCount` is in lag mode (Validate, :80-91): each poll sends INFO
  and refuses Redis < 7 (:203-235), then XINFO GROUPS on the stream (:236) and returns the group's `lag`; a stream
  that does not exist reads 0 (:240-242), a stream without the group reads its XLEN (:254-268). go-redis v9.19
  (the version KEDA v2.20.2 pins) decodes a nil lag as -1 (command.go:2990-3000), which counts as no work;
- a trigger without `consumerGroup` is in length mode: XLEN (:192-199). In rollq that is exact: workers XDEL
  every entry they ack (protocol/scripts.py, SUBMIT's comment), so a job stream holds exactly the samples queued or
  running (and cancelled ones not yet skipped, and a dead worker's not yet reclaimed: all need a worker);
- every mode is active when its count is above `activationLagCount` (:330).

Redis leaves the lag nil whenever the entry a group delivered last has been deleted while an older one is still in
the stream and newer ones wait (t_stream.c, streamReplyWithCGLag): in rollq that is a sample finishing before an
older one still running, with work queued, so lag alone could leave a busy pool as it is, or let it reach zero with
work waiting. The stream length never goes nil, so it decides: one `scalingModifiers` formula (KEDA's composite
metric; scale_handler.go:888-915 makes the object active when it is above `activationTarget`) takes the larger of
the run's total stream length and its total lag, summed over every class and partition (the HPA alone would take
the largest stream's, K times too few workers for K equal partitions), with a target of one worker's concurrency.
"""

from __future__ import annotations

import re
import sys
from typing import Annotated

from rollq.config import Settings, setting
from rollq.protocol.keys import DEFAULT_CLASS, WORKER_GROUP, RunKeys, validate_class_name

COMPONENT = "deploy/kubernetes/components/keda/keda.yaml"
CLUSTER_COMPONENT = "deploy/kubernetes/components/keda-cluster/keda.yaml"
REDIS_USER = "keda"  # deploy/redis-acl.conf's read-only user for the scaler
PASSWORD_KEY = "ROLLQ_REDIS_KEDA_PASSWORD"  # its password's key in the Secret (deploy/make_secrets.py)
SECRET = "rollq-secrets"
AUTH_NAME = "rollq-keda"


class KedaConfig(Settings, kw_only=True):
    """The KEDA ScaledObject (and its TriggerAuthentication) that scales rollq's workers on a run's queue."""

    run: Annotated[str, setting("the run whose job streams are read (ROLLQ_RUN of the manifests)", metavar="RUN")] = (
        "toy"
    )
    partitions: Annotated[int, setting("the run's partition count (its `partitions` setting)", metavar="K", ge=1)] = 1
    job_class: Annotated[
        list[str],
        setting(
            "a job class whose streams are read (repeatable; none given: train; `rollq classes list` names them)",
            flag="--class",
            metavar="NAME",
        ),
    ] = []
    cluster: Annotated[
        bool, setting("Redis is a Redis Cluster: `redis-cluster-streams` triggers, `address` is a seed node")
    ] = False
    address: Annotated[
        str,
        setting("host:port of Redis as KEDA's operator (another namespace) reaches it", metavar="HOST:PORT"),
    ] = "redis.rollq.svc:6379"
    namespace: Annotated[str, setting("namespace of the worker Deployment and of these objects")] = "rollq"
    deployment: Annotated[str, setting("the Deployment to scale")] = "worker"
    concurrency: Annotated[
        int,
        setting("samples one worker runs at once (its `concurrency`): the target per worker", metavar="N", ge=1),
    ] = 64
    max_replicas: Annotated[int, setting("most workers KEDA starts", metavar="N", ge=1)] = 10
    polling_interval_s: Annotated[int, setting("seconds between KEDA's reads of the queue", metavar="S", ge=1)] = 15
    cooldown_period_s: Annotated[
        int, setting("seconds the queue stays empty before the last worker goes (1 -> 0)", metavar="S", ge=0)
    ] = 300
    scale_down_per_minute: Annotated[
        int,
        setting(
            "most workers stopped per minute when the queue shrinks: each one stopped drains, and episodes still "
            "running after its drain_grace start again elsewhere",
            metavar="N",
            ge=1,
        ),
    ] = 1
    tls: Annotated[bool, setting("KEDA reaches Redis over TLS (a managed Redis behind rediss://)")] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        RunKeys(self.run)  # the run name's rules
        for name in self.job_class:
            validate_class_name(name)
        if len(set(self.job_class)) != len(self.job_class):
            raise ValueError(f"job classes named twice: {self.job_class}")

    @property
    def classes(self) -> list[str]:
        """The job classes read: those named, or the default class."""
        return self.job_class or [DEFAULT_CLASS]


def trigger_name(kind: str, partition: int, job_class: str) -> str:
    """A trigger's name, usable in the formula (expr-lang identifiers: letters, digits, `_`)."""
    return f"{kind}_p{partition}_{re.sub(r'[^A-Za-z0-9_]', '_', job_class)}"


def streams(cfg: KedaConfig) -> list[tuple[int, str, str]]:
    """(partition, class, stream) for every class on every partition."""
    keys = RunKeys(cfg.run)
    return [(p, c, keys.at(p).job_stream(c)) for p in range(cfg.partitions) for c in cfg.classes]


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render(cfg: KedaConfig) -> str:
    """The TriggerAuthentication and the ScaledObject, as YAML with comments."""
    rows = streams(cfg)
    names = [trigger_name(kind, p, c) for p, c, _ in rows for kind in ("inflight", "queued")]
    if len(set(names)) != len(names):
        raise ValueError(f"job classes {cfg.classes} give two triggers one name; rename one class")
    kind = "redis-cluster-streams" if cfg.cluster else "redis-streams"
    address = "addresses" if cfg.cluster else "address"
    inflight = " + ".join(trigger_name("inflight", p, c) for p, c, _ in rows)
    queued = " + ".join(trigger_name("queued", p, c) for p, c, _ in rows)
    classes = " ".join(f"--class {c}" for c in cfg.classes)
    flags = f"--run {cfg.run} --partitions {cfg.partitions} {classes}" + (" --cluster" if cfg.cluster else "")
    flags += " --tls" if cfg.tls else ""
    out = [
        f"# Generated by `rollq keda {flags}`: regenerate it for your run (docs/keda.md).",
        f"# Scales the worker Deployment on the run's job streams, read as Redis user `{REDIS_USER}` (redis-acl.conf).",
        "apiVersion: keda.sh/v1alpha1",
        "kind: TriggerAuthentication",
        "metadata:",
        f"  name: {AUTH_NAME}",
        f"  namespace: {cfg.namespace}",
        "spec:",
        "  secretTargetRef:",
        f"    # the `{REDIS_USER}` user's password (deploy/make_secrets.py); its name is in each trigger's metadata",
        "    - parameter: password",
        f"      name: {SECRET}",
        f"      key: {PASSWORD_KEY}",
        "---",
        "apiVersion: keda.sh/v1alpha1",
        "kind: ScaledObject",
        "metadata:",
        f"  name: {cfg.deployment}",
        f"  namespace: {cfg.namespace}",
        "spec:",
        "  scaleTargetRef:",
        f"    name: {cfg.deployment}",
        "  # a poll reads INFO, XINFO GROUPS and XLEN per stream: cheap; a worker starts within this of the first job",
        f"  pollingInterval: {cfg.polling_interval_s}",
        "  # the last worker stays this long after the queue empties: a trainer's weight update leaves gaps",
        f"  cooldownPeriod: {cfg.cooldown_period_s}",
        "  minReplicaCount: 0",
        "  # engines bound throughput, not workers: more workers than the engines can serve only wait",
        f"  maxReplicaCount: {cfg.max_replicas}",
        "  advanced:",
        "    horizontalPodAutoscalerConfig:",
        "      behavior:",
        "        scaleDown:",
        "          # the autoscaler picks the workers to stop without regard to what they run: a stopped worker",
        "          # drains (SIGTERM), and what still runs after its drain_grace is handed back and starts again",
        "          # elsewhere, so workers go a few at a time (after the autoscaler's 300 s stabilization window)",
        "          policies:",
        "            - type: Pods",
        f"              value: {cfg.scale_down_per_minute}",
        "              periodSeconds: 60",
        "    scalingModifiers:",
        "      # samples queued or running in the whole run (stream lengths: exact in rollq), or the lag (queued) when",
        "      # larger; summed over classes and partitions. The lag alone can read nil (-1) while work waits.",
        f"      formula: {_quote(f'max({inflight}, {queued})')}",
        f"      # one worker runs {cfg.concurrency} samples at once: workers = ceil(samples / {cfg.concurrency})",
        f'      target: "{cfg.concurrency}"',
        "      # any sample queued or running starts a worker (from zero)",
        '      activationTarget: "0"',
        "      metricType: AverageValue",
        "  triggers:",
    ]
    for p, c, stream in rows:
        for trig, mode in (("inflight", "length"), ("queued", "lag")):
            out += [
                f"    # partition {p}, class {c}: {'XLEN' if mode == 'length' else 'XINFO GROUPS lag'}",
                f"    - type: {kind}",
                f"      name: {trigger_name(trig, p, c)}",
                "      authenticationRef:",
                f"        name: {AUTH_NAME}",
                "      metadata:",
                f"        {address}: {_quote(cfg.address)}",
                f"        username: {REDIS_USER}",
                f"        stream: {_quote(stream)}",
            ]
            if cfg.tls:
                out.append('        enableTLS: "true"')
            if mode == "length":
                out.append(f'        streamLength: "{cfg.concurrency}"')
            else:
                out += [
                    f"        consumerGroup: {WORKER_GROUP}",
                    f'        lagCount: "{cfg.concurrency}"',
                ]
            out.append('        activationLagCount: "0"')
    return "\n".join(out) + "\n"


def keda(cfg: KedaConfig) -> int:
    """The `rollq keda` entry: the YAML on stdout."""
    try:
        text = render(cfg)
    except ValueError as exc:
        print(f"rollq keda: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


__all__ = ["KedaConfig", "keda", "render", "streams", "trigger_name"]
