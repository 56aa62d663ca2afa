"""The shared config file, ROLLQ_* variables and flags as every command sees them (rollq.cli.parse)."""

import pytest

from rollq.cli import COMMANDS, build_parser, parse


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
    cfg = write(
        tmp_path,
        "redis_url: redis://cfg:6379/0\nrun: from-file\n"
        "worker: {concurrency: 8, engine: [http://e0:30000], max_attempts: 5}\n",
    )
    [worker] = parse(["worker", "--config", cfg]).settings
    assert (worker.concurrency, worker.engine, worker.max_attempts) == (8, ["http://e0:30000"], 5)
    assert (worker.redis_url, worker.run) == ("redis://cfg:6379/0", "from-file")
    monkeypatch.setenv("ROLLQ_WORKER_CONCURRENCY", "16")
    monkeypatch.setenv("ROLLQ_RUN", "from-env")
    [worker] = parse(["worker", "--config", cfg]).settings
    assert (worker.concurrency, worker.run) == (16, "from-env")
    [worker] = parse(
        [
            "worker",
            "--config",
            cfg,
            "--concurrency",
            "3",
            "--run",
            "from-flag",
            "--engine",
            "http://x:1",
            "--engine",
            "http://y:2",
        ]
    ).settings
    assert (worker.concurrency, worker.run, worker.max_attempts) == (3, "from-flag", 5)
    assert worker.engine == ["http://x:1", "http://y:2"]  # a repeatable flag replaces the file's list


def test_every_command_has_its_section(tmp_path):
    cfg = write(
        tmp_path,
        "engine: {backend: reference, register: true, port: 31000}\n"
        "enqueue: {workflow: my.mod:Wf, n: 4}\nreward_worker: {max_workers: 3}\n"
        "up: {engines: 2, workers: 3}\ntrainer: {steps: 7}\nstatus: {json: true}\n",
    )
    [engine] = parse(["engine", "--config", cfg]).settings
    assert (engine.backend, engine.register, engine.port) == ("reference", True, 31000)
    [enqueue] = parse(["enqueue", "jobs.jsonl", "--config", cfg]).settings  # --workflow is required, given by the file
    assert (enqueue.file, enqueue.workflow, enqueue.n) == ("jobs.jsonl", "my.mod:Wf", 4)
    assert parse(["reward-worker", "--config", cfg]).settings[0].max_workers == 3
    assert parse(["status", "--config", cfg]).settings[0].json is True
    up, trainer = parse(["up", "--config", cfg]).settings
    assert (up.engines, up.workers, trainer.steps) == (2, 3, 7)
    assert parse(["train", "--config", cfg, "--steps", "9"]).settings[0].steps == 9


@pytest.mark.parametrize(
    "text, message",
    [
        ("worker: {concurrency: lots}", "concurrency: expected `int`, got `str`"),
        ("worker: {concurrency: 0}", "concurrency: expected `int` >= 1"),
        ("worker: {concurency: 3}", "unknown setting(s) concurency in section 'worker'"),
        ("engine: {backend: gpu}", "backend: invalid enum value 'gpu'"),
        ("workers: {concurrency: 3}", "unknown config key(s) workers"),
        ("worker: [1]", "section 'worker' must be a mapping"),
        ("run: bad name", "run: expected `str` matching"),
    ],
)
def test_a_bad_config_exits_2_with_a_message_naming_the_setting(tmp_path, capsys, text, message):
    cfg = write(tmp_path, text + "\n")
    command = "engine" if text.startswith("engine") else "worker"
    with pytest.raises(SystemExit) as exc:
        parse([command, "--config", cfg])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_flags_and_variables_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("ROLLQ_WORKER_CONCURRENCY", "many")
    with pytest.raises(SystemExit) as exc:
        parse(["worker"])
    assert exc.value.code == 2 and "concurrency: expected `int`" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        parse(["enqueue", "jobs.jsonl", "--workflow", "m:C", "--kwargs", "[1, 2]"])
    assert exc.value.code == 2 and "kwargs: expected `object | null`, got `array`" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        parse(["enqueue", "jobs.jsonl"])
    assert exc.value.code == 2 and "workflow is required" in capsys.readouterr().err


def test_plain_rollq_is_rollq_up_with_trainer_overrides():
    invocation = parse([])
    assert invocation.command.name == "up"
    up, trainer = invocation.settings
    assert up.redis_url is None and trainer.run == "default"  # `up` starts its own Redis unless one is named
    up, trainer = parse(["steps=3", "lr=0.01", "--workers", "2"]).settings
    assert (trainer.steps, trainer.lr, up.workers) == (3, 0.01, 2)
    up, trainer = parse(["up", "--redis", "redis://r:1/0"]).settings
    assert up.redis_url == trainer.redis_url == "redis://r:1/0"


def test_the_cli_options_are_the_settings_fields(capsys):
    """Every field of every section is a flag of its command, with its doc, in `rollq COMMAND --help`."""
    from rollq.cli import command_fields

    for command in COMMANDS:
        with pytest.raises(SystemExit):
            build_parser().parse_args([command.name, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # unwrap argparse's line breaks
        for _, field in command_fields(command):
            assert (field.name if field.positional else field.flag) in text, (command.name, field.name)
            assert " ".join(field.doc.split()[:4]) in text, (command.name, field.name)
