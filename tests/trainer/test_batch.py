"""Groups -> padded batches, GRPO advantages, micro-batches."""

import pytest
import torch

from rollq.protocol.codec import Codec
from rollq.protocol.messages import Sequence, Trajectory
from rollq.trainer.batch import Group, build_batch, grpo_advantages, micro_batches


def traj(
    job_id: str, index: int, ids: list[int], mask: list[int], versions: list[int], reward: float, status: str = "ok"
) -> Trajectory:
    n = len(ids)
    seq = Sequence(
        input_ids=ids, loss_mask=mask, logprobs=[-0.5 * i for i in range(n)], versions=versions, reward=reward
    )
    t = Trajectory(job_id=job_id, sample_index=index, n=2, status=status, sequences=[seq] if status == "ok" else [])
    return Codec().decode_trajectory(Codec().encode(t))  # as the trainer gets them: typed arrays off the wire


def test_grpo_advantages_are_normalised_within_the_group():
    adv = grpo_advantages(torch.tensor([0.0, 1.0, 1.0, 0.0]))
    assert torch.allclose(adv.mean(), torch.tensor(0.0), atol=1e-6)
    assert torch.allclose(adv.std(), torch.tensor(1.0), atol=1e-4)
    assert (adv[[1, 2]] > 0).all() and (adv[[0, 3]] < 0).all()
    assert torch.equal(grpo_advantages(torch.tensor([0.7, 0.7, 0.7])), torch.zeros(3))  # nothing to learn
    assert torch.equal(grpo_advantages(torch.tensor([0.7])), torch.zeros(1))


def test_without_std_norm_a_rare_penalty_weighs_what_it_costs():
    """Dr. GRPO: one -0.25 among zeros and one 1.0 among zeros weigh alike under GRPO's std; centred only, the
    penalty is a quarter of the success."""
    penalty, success = torch.tensor([-0.25, 0, 0, 0]), torch.tensor([1.0, 0, 0, 0])
    assert torch.allclose(grpo_advantages(penalty)[0], -grpo_advantages(success)[0])
    assert torch.allclose(grpo_advantages(penalty, std_norm=False), penalty - penalty.mean())
    assert torch.allclose(grpo_advantages(success, std_norm=False)[0], torch.tensor(0.75))
    g = Group(
        job_id="g", samples=[traj("g", 0, [5, 6], [0, 1], [-1, 1], 2.0), traj("g", 1, [5, 7], [0, 1], [-1, 1], 0.0)]
    )
    assert build_batch([g], std_norm=False).advantages.tolist() == [1.0, -1.0]
    assert torch.equal(grpo_advantages(torch.tensor([0.7, 0.7]), std_norm=False), torch.zeros(2))


def test_build_batch_pads_and_aligns_targets_with_their_columns():
    a = Group(
        job_id="g0",
        samples=[
            traj("g0", 0, [5, 6, 7, 8], [0, 0, 1, 1], [-1, -1, 3, 4], 1.0),
            traj("g0", 1, [5, 6, 9], [0, 0, 1], [-1, -1, 4], 0.0),
        ],
    )
    b = Group(
        job_id="g1", samples=[traj("g1", 0, [5, 1], [0, 1], [-1, 2], 0.5), traj("g1", 1, [5, 2], [0, 1], [-1, 2], 0.5)]
    )
    batch = build_batch([a, b], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [5, 6, 9, 0], [5, 1, 0, 0], [5, 2, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]]
    # column t of the per-token arrays belongs to input_ids[:, t + 1] (the token predicted at position t)
    assert batch.loss_mask.tolist() == [[0, 1, 1], [0, 1, 0], [1, 0, 0], [1, 0, 0]]
    assert batch.versions.tolist() == [[-1, 3, 4], [-1, 4, -1], [2, -1, -1], [2, -1, -1]]
    assert batch.behav_logprobs[0].tolist() == [-0.5, -1.0, -1.5]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.5, 0.5]
    assert batch.advantages[0] > 0 > batch.advantages[1] and batch.advantages[2:].tolist() == [0.0, 0.0]
    assert batch.tokens == 5


def test_group_versions_count_trained_tokens_only_and_validity():
    g = Group(
        job_id="g",
        samples=[traj("g", 0, [5, 6, 7], [0, 1, 1], [9, 3, 5], 1.0), traj("g", 1, [5, 6], [0, 1], [0, 4], 0.0)],
    )
    assert g.version_range() == (3, 5)  # the prompt's 9 and 0 are not trained
    assert g.ok and g.invalid(vocab_size=10) is None and g.model_tokens == 3
    assert "outside the model's vocabulary" in g.invalid(vocab_size=7)
    assert Group(job_id="g", samples=[traj("g", 0, [5, 6], [0, 0], [-1, -1], 1.0)]).version_range() is None
    failed = Group(
        job_id="g", samples=[traj("g", 0, [5, 6], [0, 1], [0, 0], 1.0), traj("g", 1, [], [], [], 0.0, "error")]
    )
    assert not failed.ok


@pytest.mark.parametrize("budget", [1, 16, 64, 10_000])
def test_micro_batches_cover_every_row_once_within_the_budget(budget):
    lengths = [3, 40, 7, 7, 12, 1, 33, 8]
    mbs = micro_batches(lengths, list(range(8)), budget)
    assert sorted(i for mb in mbs for i in mb) == list(range(8))
    for mb in mbs:
        assert len(mb) == 1 or len(mb) * max(lengths[i] for i in mb) <= budget
    assert [lengths[i] for mb in mbs for i in mb] == sorted(lengths)  # length-sorted: little padding
    assert micro_batches(lengths, [1, 5], 10_000) == [[5, 1]]


def test_a_min_version_masks_only_the_older_generated_tokens():
    g = Group(
        job_id="g0",
        samples=[
            traj("g0", 0, [5, 6, 7, 8, 9], [0, 0, 1, 1, 1], [-1, -1, 1, 2, 3], 1.0),  # a long answer across versions
            traj("g0", 1, [5, 6, 7], [0, 0, 1], [-1, -1, 3], 0.0),
        ],
    )
    whole = build_batch([g])
    masked = build_batch([g], min_version=2)
    assert whole.tokens == 4 and whole.masked_tokens == 0
    assert masked.tokens == 3 and masked.masked_tokens == 1  # the token of version 1 leaves the loss
    assert masked.versions[masked.loss_mask > 0].min().item() == 2
    assert torch.equal(masked.advantages, whole.advantages)  # the group's rewards still decide its advantages


def test_a_group_is_uniform_when_every_reward_it_is_normalised_over_is_equal():
    def group(*rewards: float, context: tuple[float, ...] = ()) -> Group:
        samples = [traj("g", i, [5, 6], [0, 1], [-1, 0], r) for i, r in enumerate(rewards)]
        return Group(job_id="g", samples=samples, context_rewards=list(context))

    assert group(1.0, 1.0, 1.0).uniform and group(0.0, 0.0).uniform
    assert build_batch([group(1.0, 1.0, 1.0)]).advantages.abs().sum() == 0  # what uniform stands for
    assert not group(1.0, 1.0, 0.5).uniform
    assert not group(0.5).uniform  # a lone reward: filtering it would filter every group of a group_size 1 run
    # a split group's last part: its parts trained earlier join the normalisation, so they decide too
    assert group(1.0, context=(1.0, 1.0)).uniform and not group(1.0, 1.0, context=(0.0,)).uniform
    assert group(1.0, 1.0, context=(0.0,)).rewards == [0.0, 1.0, 1.0]
