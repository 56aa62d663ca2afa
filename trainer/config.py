"""The trainer's settings: the `trainer` section of the shared config (protocol.config), then `ROLLQ_TRAINER_*`
variables, then `KEY=VALUE` overrides from the command line, each over the one before."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from protocol.config import ConfigError, parse_value, read_document, section_settings, shared_value
from protocol.connection import DEFAULT_REDIS_URL
from protocol.keys import validate_run_name

SECTION = "trainer"
SHARED = ("redis_url", "run")  # come from the file's top level / --redis / --run, not the trainer section


class TrainConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # where
    redis_url: str = DEFAULT_REDIS_URL
    run: str = "default"
    run_dir: str = "runs/latest"  # metrics.jsonl, plot.png, checkpoint.pt
    weights_dir: str = ""  # where engines read new weights (a directory they share); "" = RUN_DIR/weights
    engines: list[str] = []  # static engine URLs; engines registered for the run are used too
    # what
    model: str = "tiny"  # "tiny" (the offline model) or an HF model directory
    dataset: str = "toy:digits"  # JSONL, Parquet, a `datasets` directory saved to disk, or toy:digits
    workflow: str = "rlvr"  # a built-in loop's name or an import path
    workflow_kwargs: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"reward_fn": "trainer.toy:digits_reward", "max_new_tokens": 8})
    # how much
    steps: int = 200
    group_size: int = 8  # samples per prompt (GRPO group)
    groups_per_step: int = 8  # a step trains on group_size * groups_per_step samples (B)
    max_staleness: int = 2  # eta: a trained token is at most this many versions older than the policy trained
    # optimisation
    lr: float = 5e-4
    weight_decay: float = 0.0
    clip_eps: float = 0.2  # PPO clip of pi_theta / pi_prox
    behav_imp_cap: float = 5.0  # tokens whose pi_prox / pi_behaviour exceeds this are left out (decoupled PPO)
    ppo_minibatches: int = 1  # optimizer steps per training step
    max_tokens_per_microbatch: int = 4096  # padded tokens per forward/backward (length-sorted micro-batches)
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    # weight updates
    pause_mode: Literal["abort", "retract", "in_place"] = "retract"  # retract/in_place keep in-flight work
    checkpoint_every: int = 1  # steps; 1 makes a restart exact (nothing trained is lost or trained twice)

    def __post_init__(self) -> None:
        for name in ("steps", "group_size", "groups_per_step", "ppo_minibatches", "checkpoint_every",
                     "max_tokens_per_microbatch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if not self.behav_imp_cap > 1:
            raise ValueError(f"behav_imp_cap must be > 1, got {self.behav_imp_cap}")
        validate_run_name(self.run)

    @property
    def batch_samples(self) -> int:
        """B: samples one step trains on."""
        return self.group_size * self.groups_per_step

    @property
    def weights_root(self) -> str:
        return self.weights_dir or os.path.join(self.run_dir, "weights")


SECTION_KEYS = [k for k in TrainConfig.__struct_fields__ if k not in SHARED]


def load_config(path: str | os.PathLike[str] | None = None, *, overrides: Sequence[str] = (),
                env: Mapping[str, str] | None = None, redis_url: str | None = None, run: str | None = None,
                defaults: Mapping[str, Any] | None = None) -> TrainConfig:
    """defaults < the file's `trainer` section < ROLLQ_TRAINER_* < `KEY=VALUE` overrides. `redis_url` / `run`:
    given, else ROLLQ_REDIS_URL / ROLLQ_RUN, else the file's top level. Raises ConfigError naming what is wrong."""
    document = read_document(path)
    fields: dict[str, Any] = dict(defaults or {})
    fields.update(section_settings(document, SECTION, SECTION_KEYS, env))
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in SECTION_KEYS:
            raise ConfigError(f"override {item!r} must be KEY=VALUE with KEY one of: {', '.join(SECTION_KEYS)}")
        fields[key] = parse_value(raw)
    for key, given in (("redis_url", redis_url), ("run", run)):
        value = given or shared_value(key, document, env)
        if value:
            fields[key] = value
    try:
        return msgspec.convert(fields, TrainConfig, strict=False)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ConfigError(f"bad trainer config: {exc}") from None


__all__ = ["SECTION", "SECTION_KEYS", "TrainConfig", "load_config"]
