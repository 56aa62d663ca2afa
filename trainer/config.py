"""One typed config for the trainer and the services it starts: a YAML file, then `ROLLQ_*` environment
variables, then `key=value` overrides (command line), each over the one before."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

ENV_PREFIX = "ROLLQ_"


class TrainConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # where
    redis_url: str = "redis://localhost:6379/0"
    run: str = "default"
    run_dir: str = "runs/latest"  # metrics.jsonl, plot, checkpoints, weights
    engines: list[str] = []  # static engine URLs; engines registered for the run are used too
    # what
    model: str = "tiny"  # "tiny" (the offline model) or an HF model directory
    dataset: str = "toy:digits"  # JSONL, Parquet, a `datasets` directory saved to disk, or toy:digits
    workflow: str = "rlvr"
    workflow_kwargs: dict[str, Any] = msgspec.field(
        default_factory=lambda: {"reward_fn": "trainer.toy:digits_reward", "max_new_tokens": 8})
    # how much
    steps: int = 40
    group_size: int = 8  # samples per prompt (GRPO group)
    groups_per_step: int = 8  # so a step trains on group_size * groups_per_step samples (B)
    max_staleness: int = 2  # eta: a sample may be at most this many versions older than the policy it trains
    # optimisation
    lr: float = 3e-3
    weight_decay: float = 0.0
    clip_eps: float = 0.2  # PPO clip of pi_theta / pi_prox
    behav_imp_cap: float = 5.0  # cap of the importance weight pi_prox / pi_behaviour (decoupled PPO)
    ppo_minibatches: int = 1
    grad_clip: float = 1.0
    seed: int = 0
    # weight updates
    pause_mode: Literal["abort", "retract", "in_place"] = "retract"  # retract keeps in-flight work on SGLang
    checkpoint_every: int = 1  # steps; 1 makes a restart exact (nothing trained is lost or trained twice)
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("steps", "group_size", "groups_per_step", "ppo_minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        if not self.lr > 0:
            raise ValueError("lr must be > 0")

    @property
    def batch_samples(self) -> int:
        return self.group_size * self.groups_per_step


def _parse_value(raw: str) -> Any:
    """A command-line / environment value: YAML scalars and flow collections (`3`, `true`, `[a, b]`, `{k: v}`)."""
    import yaml

    return yaml.safe_load(raw)


def load_config(path: str | Path | None = None, *, env: Mapping[str, str] | None = None,
                overrides: Sequence[str] = ()) -> TrainConfig:
    """File < ROLLQ_<FIELD> environment < `field=value` overrides. Raises ValueError naming what is wrong."""
    import yaml

    fields: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"cannot read config {path}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"config {path} must be a mapping of settings")
        fields.update(loaded)
    names = set(TrainConfig.__struct_fields__)
    for key, raw in (os.environ if env is None else env).items():
        if key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX):].lower() in names:
            fields[key[len(ENV_PREFIX):].lower()] = _parse_value(raw)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or key.strip() not in names:
            raise ValueError(f"override {item!r} must be FIELD=VALUE with FIELD one of: {', '.join(sorted(names))}")
        fields[key.strip()] = _parse_value(raw)
    try:
        return msgspec.convert(fields, TrainConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad trainer config: {exc}") from None


__all__ = ["ENV_PREFIX", "TrainConfig", "load_config"]
