"""TrainConfig: the `trainer` section, ROLLQ_TRAINER_*, KEY=VALUE overrides."""

import pytest

from protocol.config import ConfigError
from trainer.config import TrainConfig, load_config


def test_defaults_are_the_toy_run():
    cfg = load_config(env={})
    assert cfg == TrainConfig()
    assert cfg.batch_samples == 64 and cfg.weights_root.endswith("weights")


def test_file_then_environment_then_overrides(tmp_path):
    path = tmp_path / "rollq.yaml"
    path.write_text("redis_url: redis://cfg:1/0\nrun: r-file\ntrainer:\n  steps: 7\n  lr: 0.01\n  group_size: 4\n"
                    "  workflow_kwargs: {reward_fn: m:f}\n")
    cfg = load_config(path, env={})
    assert (cfg.steps, cfg.lr, cfg.group_size, cfg.redis_url, cfg.run) == (7, 0.01, 4, "redis://cfg:1/0", "r-file")
    assert cfg.workflow_kwargs == {"reward_fn": "m:f"}
    env = {"ROLLQ_TRAINER_STEPS": "9", "ROLLQ_TRAINER_ENGINES": "[http://a:1]", "ROLLQ_RUN": "r-env"}
    cfg = load_config(path, env=env)
    assert (cfg.steps, cfg.engines, cfg.run, cfg.lr) == (9, ["http://a:1"], "r-env", 0.01)
    cfg = load_config(path, env=env, overrides=["steps=11", "pause_mode=abort"], run="r-flag")
    assert (cfg.steps, cfg.pause_mode, cfg.run) == (11, "abort", "r-flag")


@pytest.mark.parametrize("override, message", [
    ("stepz=3", "KEY one of"),
    ("steps", "must be KEY=VALUE"),
    ("steps=0", "steps must be >= 1"),
    ("lr=fast", "Expected `float`"),
    ("pause_mode=freeze", r"Invalid enum value .freeze. - at `\$.pause_mode`"),
    ("max_staleness=-1", "max_staleness must be >= 0"),
    ("redis_url=redis://x", "KEY one of"),  # shared: --redis / the file's top level, not a trainer setting
])
def test_bad_settings_are_refused_with_the_reason(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, overrides=[override])


def test_a_bad_run_name_is_refused():
    with pytest.raises(ConfigError, match="run name 'bad name'"):
        load_config(env={}, run="bad name")
