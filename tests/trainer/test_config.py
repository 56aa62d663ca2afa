"""TrainConfig through `rollq train`: the `trainer` section, ROLLQ_TRAINER_*, flags and KEY=VALUE overrides."""

import pytest

from rollq.cli import parse
from rollq.trainer.config import TrainConfig


def train_config(*argv: str, env: dict[str, str] | None = None) -> TrainConfig:
    [cfg] = parse(["train", *argv], env=env or {}).settings
    return cfg


def test_defaults_are_the_toy_run():
    cfg = train_config()
    assert cfg == TrainConfig()
    assert cfg.batch_samples == 64 and cfg.directory == "runs/default"
    assert cfg.weights_root == "runs/default/weights"


def test_file_then_environment_then_flags_and_overrides(tmp_path):
    path = tmp_path / "rollq.yaml"
    path.write_text(
        "redis_url: redis://cfg:1/0\nrun: r-file\ntrainer:\n  steps: 7\n  lr: 0.01\n  group_size: 4\n"
        "  workflow_kwargs: {reward_fn: m:f}\n"
    )
    cfg = train_config("--config", str(path))
    assert (cfg.steps, cfg.lr, cfg.group_size, cfg.redis_url, cfg.run) == (7, 0.01, 4, "redis://cfg:1/0", "r-file")
    assert cfg.workflow_kwargs == {"reward_fn": "m:f"}
    env = {"ROLLQ_TRAINER_STEPS": "9", "ROLLQ_TRAINER_ENGINE": "[http://a:1]", "ROLLQ_RUN": "r-env"}
    cfg = train_config("--config", str(path), env=env)
    assert (cfg.steps, cfg.engine, cfg.run, cfg.lr) == (9, ["http://a:1"], "r-env", 0.01)
    cfg = train_config(
        "--config", str(path), "steps=11", "pause_mode=abort", "--run", "r-flag", "--lr", "5e-4", env=env
    )
    assert (cfg.steps, cfg.pause_mode, cfg.run, cfg.lr) == (11, "abort", "r-flag", 5e-4)


@pytest.mark.parametrize(
    "override, message",
    [
        ("stepz=3", "KEY one of"),
        ("steps", "must be KEY=VALUE"),
        ("steps=0", "steps: expected `int` >= 1"),
        ("lr=fast", "lr: expected `float`"),
        ("pause_mode=freeze", "pause_mode: invalid enum value 'freeze'"),
        ("max_staleness=-1", "max_staleness: expected `int` >= 0"),
        ("clip_eps=1.5", "clip_eps: expected `float` < 1"),
        ("redis_url=redis://x", "KEY one of"),  # shared: --redis / the file's top level, not a trainer setting
    ],
)
def test_bad_settings_are_refused_with_the_reason(capsys, override, message):
    with pytest.raises(SystemExit) as exc:
        train_config(override)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_bad_run_name_is_refused(capsys):
    with pytest.raises(SystemExit):
        train_config("--run", "bad name")
    assert "run: expected `str` matching" in capsys.readouterr().err
