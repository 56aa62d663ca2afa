"""Prompt sources: JSONL, Parquet, a `datasets` directory, the toy task; and the order groups get them in."""

import json

import pytest

from rollq.trainer.data import BUILTIN_PROMPT_KEYS, DatasetError, PromptOrder, load_prompts, task_prompts

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


# -- prompt_key / answer_key, and the prompt a built-in loop reads, checked before anything starts ---------------------


def write_jsonl(path, rows, blank_after: int | None = None):
    lines = [json.dumps(r) for r in rows]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_columns_named_otherwise_map_onto_what_the_loops_read(tmp_path):
    spec = write_jsonl(tmp_path / "qa.jsonl", [{"question": "What is 2+3?", "solution": "5", "id": 1}])
    [record] = task_prompts(spec, "rlvr", prompt_key="question", answer_key="solution")
    assert record == {"prompt": "What is 2+3?", "answer": "5", "question": "What is 2+3?", "solution": "5", "id": 1}


def test_verl_layout_a_chat_column_and_a_nested_answer(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    rows = [{"prompt": chat, "reward_model": {"ground_truth": "5", "style": "rule"}, "messages": "stale text"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "verl.parquet")
    [record] = task_prompts(
        str(tmp_path / "verl.parquet"), "rlvr", prompt_key="prompt", answer_key="reward_model.ground_truth"
    )
    # the chat becomes `messages` (the line's own prompt keys give way, so the loop reads this one)
    assert record["messages"] == chat and "prompt" not in record and record["answer"] == "5"


def test_lines_without_the_prompt_a_built_in_loop_reads_are_refused_by_line(tmp_path):
    rows = [{"question": "a", "answer": "1"}] * 3
    spec = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": "fine"}, *rows], blank_after=1)
    with pytest.raises(DatasetError) as caught:
        task_prompts(spec, "rlvr")
    message = str(caught.value)
    # line 3 of the file (a blank line before it), the keys it has, and the way out
    assert f"{spec}:3 has no 'messages' or 'messages_chat' or 'prompt' or 'input_ids'" in message
    assert "its keys: 'question', 'answer'" in message and "prompt_key" in message
    with pytest.raises(DatasetError, match=r"record 1 has no 'messages'"):  # vision_rlvr reads `messages` alone
        task_prompts("toy:digits", "rollq.workers.builtin.vision_rlvr:VisionRLVRWorkflow")
    assert task_prompts(spec, "my_pkg.flows:MyWorkflow")[1] == rows[0]  # another workflow reads what it reads


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"prompt_key": "question"}, r"qa.jsonl:2 has no prompt_key column 'question'; its keys: 'q', 'solution'"),
        ({"answer_key": "solution"}, r"qa.jsonl:1 has no answer_key column 'solution'; its keys: 'question'"),
        ({"prompt_key": "n"}, r"qa.jsonl:1: prompt_key column 'n' holds a int"),
    ],
)
def test_a_mapped_column_missing_names_the_line(tmp_path, settings, message):
    spec = write_jsonl(tmp_path / "qa.jsonl", [{"question": "a", "n": 1}, {"q": "b", "solution": "2"}])
    if "answer_key" in settings:
        spec = write_jsonl(tmp_path / "qa.jsonl", [{"question": "a"}])
    with pytest.raises(DatasetError, match=message):
        task_prompts(spec, "rlvr", **settings)


def test_the_built_in_toy_tasks_pass_their_loops_check():
    for spec, workflow in [("toy:digits", "rlvr"), ("toy:add", "rlvr"), ("toy:colours", "vision_rlvr")]:
        assert task_prompts(spec, workflow)


def test_the_check_agrees_with_what_the_loop_reads():
    """BUILTIN_PROMPT_KEYS (the trainer's list) against the workers' own reading of a prompt."""
    from rollq.workers.builtin.episode import episode_prompt_ids
    from tests.scripted import tiny_tokenizer

    tok = tiny_tokenizer()
    chat = [{"role": "user", "content": "hi"}]
    forms = {"messages": chat, "messages_chat": chat, "prompt": "hi", "input_ids": [1, 2]}
    assert set(forms) == set(BUILTIN_PROMPT_KEYS["rlvr"])
    for key, value in forms.items():
        assert episode_prompt_ids(tok, {key: value})
    with pytest.raises(ValueError, match="data needs"):
        episode_prompt_ids(tok, {"question": "hi"})
