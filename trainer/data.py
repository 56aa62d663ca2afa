"""Prompts for the trainer: JSONL, Parquet, a Hugging Face `datasets` dataset saved to disk, or a built-in toy task.
Each record (a dict) becomes a job's data as it is; it needs what the workflow reads (`prompt` or `messages`)."""

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


__all__ = ["DatasetError", "PromptOrder", "load_prompts"]
