"""The run summary `rollq train` and `rollq up` print: the mean reward of the first and the last steps, over windows
that fit the run (10 steps each, half of a shorter run, first step -> last step on 2 or 3)."""

import pytest

from rollq.trainer.commands import reward_change, summarize
from rollq.trainer.metrics import RateWindow, StepRecord, TrainStats


def record(step: int, reward: float) -> StepRecord:
    stats = TrainStats(
        loss=0.0, clip_fraction=0.0, capped_fraction=0.0, importance_mean=1.0, grad_norm=0.0, behav_prox_gap=0.0
    )
    return StepRecord(
        step=step,
        version=step,
        reward_mean=reward,
        reward_max=reward,
        reward_min=reward,
        samples=4,
        trained_samples=4 * step,
        groups=[],
        dropped={},
        dropped_this_step={},
        staleness_mean=0.0,
        staleness_max=0,
        staleness_hist={},
        trained_tokens=0,
        gen_tokens_per_s=0.0,
        samples_per_s=0.0,
        collect_s=0.0,
        train_s=0.0,
        step_s=0.0,
        pause_s=0.0,
        weight_load_s=0.0,
        ledger_version=step,
        ledger_admitted=0,
        ledger_limit=0,
        elapsed_s=float(step),
        time=0.0,
        train=stats,
    )


@pytest.mark.parametrize(
    "rewards, window, first, last, words",
    [
        ([0.1, 0.5, 0.9], 1, 0.1, 0.9, "mean reward 0.100 (step 1) -> 0.900 (step 3)"),
        ([0.1, 0.3, 0.5, 0.7], 2, 0.2, 0.6, "mean reward 0.200 (first 2 steps) -> 0.600 (last 2)"),
        ([0.0] * 10 + [1.0] * 20, 10, 0.0, 1.0, "mean reward 0.000 (first 10 steps) -> 1.000 (last 10)"),
        ([0.4], 1, 0.4, 0.4, "mean reward 0.400 (step 1)"),
    ],
)
def test_the_reward_comparison_averages_windows_that_fit_the_run(rewards, window, first, last, words):
    summary = summarize([record(i + 1, r) for i, r in enumerate(rewards)])
    assert summary["reward_window"] == window
    assert summary["reward_first10"] == pytest.approx(first) and summary["reward_last10"] == pytest.approx(last)
    assert reward_change(summary) == words


def test_a_run_of_three_steps_no_longer_compares_its_whole_run_with_itself():
    """F14: `mean reward 0.125 (first 10 steps) -> 0.125 (last 10)` on a 3-step run."""
    summary = summarize([record(1, 0.0), record(2, 0.125), record(3, 0.375)])
    assert summary["reward_first10"] != summary["reward_last10"]
    assert "10" not in reward_change(summary)


def test_the_rolling_rate_of_a_step_that_read_nothing_itself_reaches_back_to_the_last_read():
    """F14: a step that trains groups an earlier step read (one read takes every result that has finished) reads
    nothing itself; a window of only such steps said `0 tok/s` while the engines generated."""
    window = RateWindow(10.0, start=0.0)
    assert window.rates(12.0, 600) == (50.0,)  # step 1 read 600 tokens
    assert window.rates(13.0, 600) == pytest.approx((600 / 13,))  # step 2 trained what step 1 read
    assert window.rates(30.0, 600) == (20.0,)  # step 3 too: 600 tokens over the 30 s, not 0 over 17 s
    assert window.rates(45.0, 900) == (20.0,)  # step 4 read again: its window is back to >= 10 s, 300 over 15 s
    assert window.rates(50.0, 1000) == (20.0,)  # 400 over 20 s: the window is at least 10 s long
