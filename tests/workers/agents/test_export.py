"""Rewards along the conversation tree and the individual / concat exports, on hand-built records."""

from __future__ import annotations

import pytest

from rollq.workers.agents.export import AgentOutputError, assign_rewards, export, tree_rewards
from rollq.workers.proxy.sessions import CompletionRecord


def rec(
    rid: str, order: int, parent: str | None, prompt: list[int], out: list[int], choice: int = 0
) -> CompletionRecord:
    return CompletionRecord(
        id=rid,
        choice=choice,
        order=order,
        parent=parent,
        prompt_ids=prompt,
        output_ids=out,
        output_logprobs=[-0.5 - 0.01 * t for t in out],
        output_versions=[order] * len(out),
        finish_reason="stop",
    )


def conversation() -> list[CompletionRecord]:
    """root -> a (turn 2) -> b (turn 3), and root -> side (a branch created *after* b)."""
    root = rec("root", 1, None, [1, 2], [3, 4])
    a = rec("a", 2, "root", [1, 2, 3, 4, 5], [6])
    b = rec("b", 3, "a", [1, 2, 3, 4, 5, 6, 7, 8], [9, 10])
    side = rec("side", 4, "root", [1, 2, 3, 4, 11], [12])
    return [root, a, b, side]


def test_float_reward_goes_to_the_last_request_and_flows_up_the_tree_not_creation_order():
    records = conversation()
    assign_rewards(records, 1.0)  # last created: "side"
    values = tree_rewards(records, 0.5)
    assert values["side"] == 1.0
    assert values["b"] == 0.0 and values["a"] == 0.0  # b's branch got nothing; creation order would give it 0.5
    assert values["root"] == pytest.approx(0.5 * (0.0 + 1.0) / 2)  # mean over children (a: 0, side: 1)


def test_dict_rewards_and_discount_along_parent_links():
    records = conversation()
    assign_rewards(records, {"b": 1.0, "side": 0.0})
    values = tree_rewards(records, 0.9)
    assert values == pytest.approx({"b": 1.0, "a": 0.9, "side": 0.0, "root": 0.9 * (0.9 + 0.0) / 2})


def test_a_rewarded_completion_also_gets_its_discounted_child_return_as_in_areal():
    """AReaL's apply_reward_discount: value = own reward (unset or an explicit 0 alike) + discount * later value."""
    records = conversation()[:3]  # root -> a -> b
    assign_rewards(records, {"root": 0.0, "a": 0.5, "b": 1.0})
    assert tree_rewards(records, 0.9) == pytest.approx({"b": 1.0, "a": 0.5 + 0.9, "root": 0.0 + 0.9 * (0.5 + 0.9)})
    unset = conversation()[:3]
    assign_rewards(unset, {"a": 0.5, "b": 1.0})  # root unset: the same as its explicit 0 above
    assert tree_rewards(unset, 0.9) == tree_rewards(records, 0.9)


def test_the_areal_docs_example_a_b_c():
    """docs/en/reference/agent_workflow.md: A -> B -> C (leaf, reward 1.0), discount 0.9 -> B 0.9, A 0.81."""
    records = conversation()[:3]
    assign_rewards(records, 1.0)  # the last completion, b
    assert tree_rewards(records, 0.9) == pytest.approx({"b": 1.0, "a": 0.9, "root": 0.81})


def test_n_choices_share_a_response_id_and_can_be_rewarded_one_by_one():
    records = [rec("r", 1, None, [1], [2]), rec("r", 1, None, [1], [3], choice=1)]
    assign_rewards(records, {"r": 0.25})
    assert [r.reward for r in records] == [0.25, 0.25]
    assign_rewards(records, {"r:1": 1.0})
    assert [r.reward for r in records] == [0.25, 1.0]


@pytest.mark.parametrize(
    "result, message",
    [
        ({"nope": 1.0}, "unknown completion id 'nope'"),
        ({"root": "high"}, "must be a finite number"),
        (float("nan"), "must be a finite number"),
        ("1.0", "must be a finite number"),
        (True, "must be a finite number"),
    ],
)
def test_bad_agent_results_say_what_is_wrong(result, message):
    with pytest.raises(AgentOutputError, match=message):
        assign_rewards(conversation(), result)


def test_no_completions_is_an_error():
    with pytest.raises(AgentOutputError, match="no completion through the proxy"):
        assign_rewards([], 1.0)


def test_individual_export_one_sequence_per_completion():
    records = conversation()
    assign_rewards(records, {"b": 1.0, "side": 0.5})
    seqs = export(records, "individual", 1.0)
    assert len(seqs) == 4
    b = seqs[2]
    assert b["input_ids"] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert b["loss_mask"] == [0] * 8 + [1, 1]
    assert b["logprobs"][8:] == [-0.59, -0.6] and b["versions"] == [-1] * 8 + [3, 3]


def test_concat_export_one_sequence_per_branch_with_every_model_turn_trained():
    records = conversation()
    assign_rewards(records, {"b": 1.0, "side": 0.5})
    seqs = export(records, "concat", 1.0)
    assert [s["reward"] for s in seqs] == [1.0, 0.5]  # leaves b and side
    b, side = seqs
    assert b["input_ids"] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert b["loss_mask"] == [0, 0, 1, 1, 0, 1, 0, 0, 1, 1]  # root's 3,4; a's 6; b's 9,10
    assert b["versions"] == [-1, -1, 1, 1, -1, 2, -1, -1, 3, 3]
    assert b["logprobs"][5] == pytest.approx(-0.56)
    assert side["input_ids"] == [1, 2, 3, 4, 11, 12] and side["loss_mask"] == [0, 0, 1, 1, 0, 1]


def test_concat_starts_a_new_sequence_where_a_child_does_not_extend_its_parent():
    """A re-rendered conversation (the proxy's `template` continuation) is not a token extension: the child starts
    its own sequence, and the parent's sequence ends with the parent, rewarded with its return."""
    records = [rec("p", 1, None, [1], [2]), rec("c", 2, "p", [1, 9, 3], [4])]
    assign_rewards(records, 1.0)
    p, c = export(records, "concat", 0.5)
    assert (p["input_ids"], p["loss_mask"], p["reward"]) == ([1, 2], [0, 1], 0.5)
    assert (c["input_ids"], c["loss_mask"], c["reward"]) == ([1, 9, 3, 4], [0, 0, 0, 1], 1.0)
