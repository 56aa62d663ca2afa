"""Prompts for the trainer: JSONL, Parquet, a Hugging Face `datasets` dataset saved to disk, a built-in toy task, or
a generated task (reasoning-gym's, or a user's own generator: rollq.tasks.generated). Each record (a dict) becomes a
job's data as it is; it needs what the workflow reads (`prompt` or `messages`)."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from rollq.producer.jsonl import JsonlError, json_objects

if TYPE_CHECKING:
    from rollq.trainer.config import TrainConfig

HELD_OUT_DRAWS = 4  # a held-out draw that loses prompts to the training set is redrawn twice as large, this often


class DatasetError(ValueError):
    pass


class TaskSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How a generated task's prompts are made (the trainer's task_* settings): `size` prompts from `seed`, the
    task's `config`, the chat's `system_prompt`; `exclude`: questions left out (the training prompts', for the
    held-out ones)."""

    size: int = 1000
    seed: int = 0
    config: dict[str, Any] = {}
    system_prompt: str = "default"
    examples: int = 0  # worked examples before each question: the first entries of `examples_seed`'s prompts
    examples_seed: int = 0
    exclude: frozenset[str] = frozenset()


def run_prompts(config: TrainConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training prompts and the held-out ones (none without eval_dataset). A generated task's held-out prompts
    come from its own seed (eval_task_seed), and any whose question the training prompts hold is replaced by
    another: no held-out prompt is trained on."""
    shared = TaskSettings(
        config=config.task_config,
        system_prompt=config.task_system_prompt,
        examples=config.task_examples,
        examples_seed=config.task_seed,  # the training prompts' first entries: no held-out answer is shown
    )
    replace = msgspec.structs.replace
    train = load_prompts(config.dataset, replace(shared, size=config.task_size, seed=config.task_seed))
    if not config.eval_dataset:
        return train, []
    trained = frozenset(str(r["entry"]["question"]) for r in train if isinstance(r.get("entry"), dict))
    held_out = replace(shared, size=config.eval_task_size, seed=config.eval_task_seed, exclude=trained)
    return train, load_prompts(config.eval_dataset, held_out)


def _generated(spec: str, settings: TaskSettings) -> list[dict[str, Any]]:
    from rollq.module_paths import add_module_paths
    from rollq.tasks.generated import TaskError, TaskSpec, build, generate, system_prompt, worked_examples

    if not spec.startswith("reasoning-gym:"):
        # The trainer imports a user's generator from the installed packages, then the working directory (as the
        # workers of `rollq up` do when no module_paths are given).
        add_module_paths([os.getcwd()])
    draw = settings.size
    try:
        prompt = system_prompt(settings.system_prompt)
        examples: list[dict[str, Any]] = []
        if settings.examples:
            # one more than shown: a prompt whose own question is among them is shown the others
            shown = TaskSpec(
                source=spec, size=settings.examples + 1, seed=settings.examples_seed, config=dict(settings.config)
            )
            examples = worked_examples(build(shown), shown)
        for _ in range(HELD_OUT_DRAWS):
            task_spec = TaskSpec(source=spec, size=draw, seed=settings.seed, config=dict(settings.config))
            records = generate(build(task_spec), task_spec, prompt, examples, settings.examples)
            records = [r for r in records if str(r["entry"]["question"]) not in settings.exclude]
            if len(records) >= settings.size:
                return records[: settings.size]
            draw *= 2
    except TaskError as exc:
        raise DatasetError(str(exc)) from None
    except Exception as exc:  # the user's factory failed in its own way
        raise DatasetError(f"task {spec!r}: {type(exc).__name__}: {exc}") from None
    raise DatasetError(
        f"task {spec!r} makes only {len(records)} prompts from seed {settings.seed} (of {draw // 2} drawn) whose "
        f"question is not among the training prompts, fewer than the {settings.size} asked for: its config leaves "
        "few distinct questions; ask for fewer (eval_task_size, task_size) or widen task_config"
    )


def load_prompts(spec: str, task: TaskSettings | None = None) -> list[dict[str, Any]]:
    """The records `spec` names; `task`: how a generated task's are made (default TaskSettings())."""
    if spec.startswith("toy:"):
        from rollq.tasks import addition, colours, digits

        builtin = {
            "toy:digits": digits.prompts,
            "toy:add": addition.prompts,
            "toy:add-heldout": addition.held_out,
            "toy:colours": colours.prompts,
            "toy:colours-heldout": colours.held_out,
        }
        if spec not in builtin:
            raise DatasetError(f"unknown toy task {spec!r} ({', '.join(builtin)})")
        return builtin[spec]()
    from rollq.tasks.generated import is_task_source

    path = Path(spec).expanduser()
    if not path.exists() and is_task_source(spec):
        return _generated(spec, task or TaskSettings())
    if not path.exists():
        raise DatasetError(
            f"dataset {spec!r} does not exist (a .jsonl/.parquet file, a datasets directory, a built-in toy:NAME, "
            "reasoning-gym:NAME or a generator MODULE:FACTORY)"
        )
    if path.is_dir():
        try:
            import datasets
        except ImportError:
            raise DatasetError(f"{spec} is a directory: reading a saved dataset needs `pip install datasets`") from None
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        records = [dict(r) for r in ds]
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        records = pq.read_table(path).to_pylist()
    else:
        try:
            records = [record for _, record in json_objects(path.read_text().splitlines(), spec)]
        except JsonlError as exc:
            raise DatasetError(str(exc)) from None
    if not records:
        raise DatasetError(f"dataset {spec!r} has no records")
    return records


class PromptOrder:
    """Prompt of the i-th group: every epoch visits each record once in a seeded shuffle. A pure function of i,
    so a restarted trainer re-offers exactly the groups it offered before."""

    def __init__(self, records: list[dict[str, Any]], seed: int = 0) -> None:
        if not records:
            raise DatasetError("no prompts")
        self.records = records
        self.seed = seed
        self._epoch = -1
        self._order: list[int] = []

    def __getitem__(self, index: int) -> dict[str, Any]:
        epoch, position = divmod(index, len(self.records))
        if epoch != self._epoch:
            self._order = list(range(len(self.records)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._epoch = epoch
        return self.records[self._order[position]]


__all__ = ["DatasetError", "PromptOrder", "TaskSettings", "load_prompts", "run_prompts"]
