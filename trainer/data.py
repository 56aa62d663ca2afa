"""Prompts for the trainer: JSONL, Parquet, a Hugging Face `datasets` dataset saved to disk, a built-in toy task, or
a generated task (reasoning-gym's, or a user's own generator: rollq.tasks.generated). Each record (a dict) becomes a
job's data; it needs what the workflow reads (`prompt`, `messages` or `input_ids` for the built-in loops, checked
here; columns named otherwise are mapped by prompt_key / answer_key)."""

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
    keys = {"prompt_key": config.prompt_key, "answer_key": config.answer_key}
    train_task = replace(shared, size=config.task_size, seed=config.task_seed)
    train = task_prompts(config.dataset, config.workflow, task=train_task, **keys)
    if not config.eval_dataset:
        return train, []
    trained = frozenset(str(r["entry"]["question"]) for r in train if isinstance(r.get("entry"), dict))
    held_out = replace(shared, size=config.eval_task_size, seed=config.eval_task_seed, exclude=trained)
    return train, task_prompts(config.eval_dataset, config.workflow, task=held_out, **keys)


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


# What rollq's built-in loops read as a line's prompt (rollq.workers.builtin.episode.episode_prompt_ids; the trainer
# names, not imports, the workers' code), by the name a run gives the loop.
_TEXT_PROMPT_KEYS = ("messages", "messages_chat", "prompt", "input_ids")
BUILTIN_PROMPT_KEYS: dict[str, tuple[str, ...]] = {
    "rlvr": _TEXT_PROMPT_KEYS,
    "multi_turn": _TEXT_PROMPT_KEYS,
    "tool_agent": _TEXT_PROMPT_KEYS,
    "vision_rlvr": ("messages",),
}
for _name, _path in (
    ("rlvr", "rollq.workers.builtin.rlvr:RLVRWorkflow"),
    ("multi_turn", "rollq.workers.builtin.multi_turn:MultiTurnWorkflow"),
    ("tool_agent", "rollq.workers.builtin.tool_agent:ToolAgentWorkflow"),
    ("vision_rlvr", "rollq.workers.builtin.vision_rlvr:VisionRLVRWorkflow"),
):
    BUILTIN_PROMPT_KEYS[_path] = BUILTIN_PROMPT_KEYS[_path.replace(":", ".")] = BUILTIN_PROMPT_KEYS[_name]
_MISSING = object()


def map_columns(
    records: list[dict[str, Any]], spec: str, *, prompt_key: str = "", answer_key: str = ""
) -> list[dict[str, Any]]:
    """Each record with `prompt_key`'s column as its prompt (a string: `prompt`, one user turn; a list of messages:
    `messages`; the record's own prompt keys give way, so the loop reads this one) and `answer_key`'s column as
    `answer` (a dotted key reaches into mappings: verl's `reward_model.ground_truth`). The other columns stay."""
    if not prompt_key and not answer_key:
        return records
    out = []
    for index, record in enumerate(records):
        mapped = dict(record)
        if prompt_key:
            value = _column(record, prompt_key)
            if value is _MISSING or value is None:
                raise DatasetError(_missing(spec, index, f"prompt_key column {prompt_key!r}", record))
            for key in _TEXT_PROMPT_KEYS:
                mapped.pop(key, None)
            if isinstance(value, str):
                mapped["prompt"] = value
            elif isinstance(value, list) and all(isinstance(m, dict) for m in value):
                mapped["messages"] = value
            else:
                raise DatasetError(
                    f"{_where(spec, index)}: prompt_key column {prompt_key!r} holds a {type(value).__name__}, not a "
                    "string or a list of chat messages"
                )
        if answer_key:
            value = _column(record, answer_key)
            if value is _MISSING:
                raise DatasetError(_missing(spec, index, f"answer_key column {answer_key!r}", record))
            mapped["answer"] = value
        out.append(mapped)
    return out


def check_prompt_keys(records: list[dict[str, Any]], spec: str, workflow: str) -> None:
    """A built-in loop's lines each need a prompt it reads (BUILTIN_PROMPT_KEYS): checked before anything starts,
    not by the first samples failing on the workers. Another workflow reads what it reads: not checked."""
    keys = BUILTIN_PROMPT_KEYS.get(workflow)
    if keys is None:
        return
    for index, record in enumerate(records):
        if not any(record.get(key) is not None for key in keys):
            wanted = " or ".join(f"{k!r}" for k in keys)
            raise DatasetError(
                _missing(spec, index, f"{wanted} (what the {workflow!r} loop reads as the prompt)", record)
                + "; for a column named otherwise, set prompt_key (docs/rewards.md)"
            )


def _column(record: dict[str, Any], key: str) -> Any:
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _missing(spec: str, index: int, what: str, record: dict[str, Any]) -> str:
    has = ", ".join(repr(k) for k in record) or "none"
    return f"{_where(spec, index)} has no {what}; its keys: {has}"


def _where(spec: str, index: int) -> str:
    """`file.jsonl:LINE` for a JSONL file (blank lines counted, as an editor does); `spec: record N` otherwise."""
    path = Path(spec).expanduser()
    if not spec.startswith("toy:") and path.is_file() and path.suffix != ".parquet":
        try:
            lines = [n for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
            return f"{spec}:{lines[index]}"
        except (OSError, UnicodeDecodeError, IndexError):
            pass
    return f"{spec}: record {index + 1}"


def task_prompts(
    spec: str, workflow: str, *, prompt_key: str = "", answer_key: str = "", task: TaskSettings | None = None
) -> list[dict[str, Any]]:
    """The prompts of a run's dataset (or eval_dataset) as its workflow gets them: loaded (`task`: how a generated
    task's are made), columns mapped (prompt_key, answer_key), every line checked for the prompt a built-in loop
    reads."""
    records = map_columns(load_prompts(spec, task), spec, prompt_key=prompt_key, answer_key=answer_key)
    check_prompt_keys(records, spec, workflow)
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


__all__ = [
    "BUILTIN_PROMPT_KEYS",
    "DatasetError",
    "PromptOrder",
    "TaskSettings",
    "check_prompt_keys",
    "load_prompts",
    "map_columns",
    "run_prompts",
    "task_prompts",
]
