"""The shared config file and ROLLQ_* variables as every command sees them (rollq.cli.parse)."""

import pytest

from rollq.cli import parse


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for var in [v for v in os.environ if v.startswith("ROLLQ_") and v != "ROLLQ_CACHE"]:
        monkeypatch.delenv(var)


def write(tmp_path, text: str) -> str:
    path = tmp_path / "rollq.yaml"
    path.write_text(text)
    return str(path)


def test_a_service_takes_its_section_then_the_environment_then_its_flags(tmp_path, monkeypatch):
    cfg = write(tmp_path, "redis_url: redis://cfg:6379/0\nrun: from-file\n"
                          "worker: {concurrency: 8, engine: [http://e0:30000], max_attempts: 5}\n")
    args = parse(["worker", "--config", cfg])
    assert (args.concurrency, args.engine, args.max_attempts) == (8, ["http://e0:30000"], 5)
    assert (args.redis, args.run) == ("redis://cfg:6379/0", "from-file")
    monkeypatch.setenv("ROLLQ_WORKER_CONCURRENCY", "16")
    monkeypatch.setenv("ROLLQ_RUN", "from-env")
    args = parse(["worker", "--config", cfg])
    assert (args.concurrency, args.run) == (16, "from-env")
    args = parse(["worker", "--config", cfg, "--concurrency", "3", "--run", "from-flag"])
    assert (args.concurrency, args.run, args.max_attempts) == (3, "from-flag", 5)


def test_every_command_has_its_section(tmp_path):
    cfg = write(tmp_path, "engine: {backend: reference, register: true, port: 31000}\n"
                          "enqueue: {workflow: my.mod:Wf, n: 4}\nreward_worker: {max_workers: 3}\n"
                          "up: {engines: 2, workers: 3}\n")
    engine = parse(["engine", "--config", cfg])
    assert (engine.backend, engine.register, engine.port) == ("reference", True, 31000)
    enqueue = parse(["enqueue", "jobs.jsonl", "--config", cfg])  # --workflow is required, and given by the file
    assert (enqueue.workflow, enqueue.n) == ("my.mod:Wf", 4)
    assert parse(["reward-worker", "--config", cfg]).max_workers == 3
    up = parse(["up", "--config", cfg])
    assert (up.engines, up.workers) == (2, 3)


@pytest.mark.parametrize("text, message", [
    ("worker: {concurrency: lots}", "Expected `int`, got `str` - at `$.concurrency`"),
    ("worker: {concurency: 3}", "unknown setting(s) concurency in section 'worker'"),
    ("engine: {backend: gpu}", "backend must be one of synthetic, reference, sglang"),
    ("workers: {concurrency: 3}", "unknown config key(s) workers"),
    ("worker: [1]", "section 'worker' must be a mapping"),
])
def test_a_bad_config_exits_2_with_a_message_naming_the_setting(tmp_path, capsys, text, message):
    cfg = write(tmp_path, text + "\n")
    command = "engine" if text.startswith("engine") else "worker"
    with pytest.raises(SystemExit) as exc:
        parse([command, "--config", cfg])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_environment_variable_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("ROLLQ_WORKER_CONCURRENCY", "many")
    with pytest.raises(SystemExit) as exc:
        parse(["worker"])
    assert exc.value.code == 2 and "$.concurrency" in capsys.readouterr().err


def test_plain_rollq_is_rollq_up_with_trainer_overrides():
    args = parse([])
    assert args.command == "up" and args.overrides == []
    args = parse(["steps=3", "lr=0.01"])
    assert args.command == "up" and args.overrides == ["steps=3", "lr=0.01"]
    assert not args.redis_given and args.run == "default"
