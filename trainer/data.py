"""Prompts for the trainer: JSONL, Parquet, a Hugging Face `datasets` dataset saved to disk, or a built-in toy task.
Each record (a dict) becomes a job's data as it is; it needs what the workflow reads (`prompt` or `messages`)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    pass


def load_prompts(spec: str) -> list[dict[str, Any]]:
    if spec.startswith("toy:"):
        from trainer import toy

        if spec != "toy:digits":
            raise DatasetError(f"unknown toy task {spec!r} (toy:digits)")
        return toy.prompts()
    path = Path(spec).expanduser()
    if not path.exists():
        raise DatasetError(f"dataset {spec!r} does not exist (a .jsonl/.parquet file, a datasets directory or toy:digits)")
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
        records = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{spec}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise DatasetError(f"{spec}:{lineno}: expected a JSON object")
            records.append(record)
    if not records:
        raise DatasetError(f"dataset {spec!r} has no records")
    return records


class PromptStream:
    """Endless prompts, reshuffled every epoch; `position` makes a restarted trainer continue where it was."""

    def __init__(self, records: list[dict[str, Any]], seed: int = 0, position: int = 0) -> None:
        self.records = records
        self.seed = seed
        self.position = position

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            epoch, index = divmod(self.position, len(self.records))
            order = list(range(len(self.records)))
            random.Random(self.seed + epoch).shuffle(order)
            self.position += 1
            yield self.records[order[index]]


__all__ = ["DatasetError", "PromptStream", "load_prompts"]
