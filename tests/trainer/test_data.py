"""Prompt sources: JSONL, Parquet, a `datasets` directory, the toy task; and the order groups get them in."""

import json

import pytest

from rollq.trainer.data import DatasetError, PromptOrder, load_prompts

ROWS = [{"prompt": f"question {i}", "answer": str(i)} for i in range(5)]


def test_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS[:2]) + "\n\n" + json.dumps(ROWS[2]) + "\n")
    assert load_prompts(str(path)) == ROWS[:3]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"prompt": "a"}\n{"prompt": \n', r"p.jsonl:2: not valid JSON"),
        ('{"prompt": "a"}\n[1, 2]\n', r"p.jsonl:2: expected a JSON object"),
        ("\n\n", "has no records"),
    ],
)
def test_bad_jsonl_names_the_line(tmp_path, text, message):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(DatasetError, match=message):
        load_prompts(str(path))


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "p.parquet")
    assert load_prompts(str(tmp_path / "p.parquet")) == ROWS


def test_datasets_saved_to_disk_dataset_and_dict(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert load_prompts(str(tmp_path / "ds")) == ROWS
    datasets.DatasetDict(
        {"test": datasets.Dataset.from_list(ROWS[:1]), "train": datasets.Dataset.from_list(ROWS[1:])}
    ).save_to_disk(str(tmp_path / "dd"))
    assert load_prompts(str(tmp_path / "dd")) == ROWS[1:]  # the train split


def test_missing_and_unknown_sources(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DatasetError, match="unknown toy task"):
        load_prompts("toy:chess")
    assert len(load_prompts("toy:digits")) > 0


def test_prompt_order_is_a_pure_function_of_the_group_index():
    records = [{"i": i} for i in range(7)]
    a, b = PromptOrder(records, seed=3), PromptOrder(records, seed=3)
    forward = [a[i]["i"] for i in range(21)]
    backward = [b[i]["i"] for i in reversed(range(21))][::-1]  # random access gives the same answers
    assert forward == backward
    for epoch in range(3):  # every epoch visits each record once
        assert sorted(forward[epoch * 7 : (epoch + 1) * 7]) == list(range(7))
    assert forward[:7] != forward[7:14]  # reshuffled per epoch
    assert [PromptOrder(records, seed=4)[i]["i"] for i in range(7)] != forward[:7]
