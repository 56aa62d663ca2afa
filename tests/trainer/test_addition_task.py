"""The built-in arithmetic task of `--model smollm2`: its reward, its train / held-out split, and the settings that
`model: smollm2` implies (anything given explicitly wins)."""

from __future__ import annotations

import pytest

from rollq.cli import parse
from rollq.tasks.addition import SYSTEM, addition_reward, held_out, prompts
from rollq.trainer.config import TrainConfig, smollm2_task
from rollq.trainer.data import DatasetError, load_prompts


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("12", 1.0),
        (" 12.", 1.0),
        ("The answer is 12.", 1.0),
        ("7 + 5 = 12", 1.0),
        ("7 + 5 = 12\n", 1.0),
        ("12 is the sum of 7 and 5", 0.0),  # ends on 5
        ("7 + 5 + 2", 0.0),  # cut off mid-sum
        ("13", 0.0),
        ("-12", 0.0),
        ("The answer is", 0.0),  # cut off before any number
        ("", 0.0),
    ],
)
def test_the_reward_is_the_last_number_written(completion, reward):
    assert addition_reward("What is 7 + 5?", completion, answer=12) == reward


def test_held_out_sums_are_never_trained_on():
    train, test = load_prompts("toy:add"), load_prompts("toy:add-heldout")
    assert len(train) == 80 and len(test) == 20
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    assert {r["id"] for r in train} | {r["id"] for r in test} == {f"{a}+{b}" for a in range(10) for b in range(10)}
    assert train == prompts() and test == held_out()  # the split is fixed, not drawn per run
    for r in train + test:
        a, b = map(int, r["id"].split("+"))
        assert r["answer"] == a + b
        assert r["messages"] == [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {a} + {b}?"},
        ]
    with pytest.raises(DatasetError, match="toy:add-heldout"):  # the error lists the built-in tasks
        load_prompts("toy:sub")


def test_model_smollm2_implies_its_task_and_explicit_settings_win():
    cfg = parse(["up", "--model", "smollm2"], env={}).settings[1]
    task = smollm2_task()
    assert cfg.dataset == "toy:add" and cfg.eval_dataset == "toy:add-heldout"
    assert cfg.workflow_kwargs == task["workflow_kwargs"] and cfg.lr == task["lr"] and cfg.steps == task["steps"]
    # a flag, a KEY=VALUE and a variable each win over what the model implies
    cfg = parse(["up", "--model", "smollm2", "--lr", "1e-4", "steps=3"], env={"ROLLQ_TRAINER_GROUP_SIZE": "2"})
    assert (cfg.settings[1].lr, cfg.settings[1].steps, cfg.settings[1].group_size) == (1e-4, 3, 2)
    assert cfg.settings[1].dataset == "toy:add"
    # the model named by a variable implies the same; the tiny model keeps the digits task
    assert parse(["train"], env={"ROLLQ_TRAINER_MODEL": "smollm2"}).settings[0].dataset == "toy:add"
    assert parse(["up"], env={}).settings[1].dataset == "toy:digits"
    # Python construction is explicit: nothing is implied there
    assert TrainConfig(model="smollm2").dataset == "toy:digits"
