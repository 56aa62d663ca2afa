"""Prompts for the trainer: JSONL, Parquet, a Hugging Face `datasets` dataset saved to disk, or a built-in toy task.
Each record (a dict) becomes a job's data; it needs what the workflow reads (`prompt`, `messages` or `input_ids` for
the built-in loops, checked here; columns named otherwise are mapped by prompt_key / answer_key)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rollq.producer.jsonl import JsonlError, json_objects


class DatasetError(ValueError):
    pass


def load_prompts(spec: str) -> list[dict[str, Any]]:
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
    path = Path(spec).expanduser()
    if not path.exists():
        raise DatasetError(
            f"dataset {spec!r} does not exist (a .jsonl/.parquet file, a datasets directory or a built-in toy:NAME)"
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


def task_prompts(spec: str, workflow: str, *, prompt_key: str = "", answer_key: str = "") -> list[dict[str, Any]]:
    """The prompts of a run's dataset (or eval_dataset) as its workflow gets them: loaded, columns mapped
    (prompt_key, answer_key), every line checked for the prompt a built-in loop reads."""
    records = map_columns(load_prompts(spec), spec, prompt_key=prompt_key, answer_key=answer_key)
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
    "check_prompt_keys",
    "load_prompts",
    "map_columns",
    "task_prompts",
]
