"""bench/staleness_model.py's model of the waste under the exact bound: checked against cases worked by hand,
against its own monotonicity, and for the start phase it depends on."""

from __future__ import annotations

from bench.staleness_model import waste_model


def test_answers_that_finish_within_the_window_waste_nothing():
    # 512 tokens x 5 ms = 2.56 s; with a step every 2 s a group spans at most 2 updates: eta = 2 holds every token
    assert waste_model(2.0, groups=2_000) == 0.0


def test_a_fixed_length_group_wastes_exactly_its_tokens_past_the_bound():
    # Every sample 100 tokens (xmin 100, cap 100): 1 s of decoding from a start s in [0, T), T = 0.25 s. It ends in
    # (1, 1.25), so the step publishing version 5 (at 1.25 s) trains it at policy version j = 4; tokens generated
    # before (j - eta) * T = 0.5 s are past the bound: (0.5 - s) / 1 s of them, 0.375 on average over s.
    floor = waste_model(0.25, xmin=100, cap=100, alpha=50, token_latency=0.01, group_size=1, groups=5_000)
    assert 0.36 <= floor <= 0.39
    assert waste_model(0.25, eta=10, xmin=100, cap=100, alpha=50, token_latency=0.01, group_size=1) == 0.0


def test_less_waste_with_slower_updates_and_without_group_mates():
    periods = [0.5, 0.7, 0.9, 1.1]
    group = [waste_model(t, groups=5_000) for t in periods]
    alone = [waste_model(t, groups=5_000, own=True) for t in periods]
    assert group == sorted(group, reverse=True) and alone == sorted(alone, reverse=True)
    assert all(a < g for a, g in zip(alone, group, strict=True))  # short samples age while their group finishes


def test_groups_started_at_an_update_waste_nothing_where_their_longest_answer_fits_eta_plus_one_periods():
    # 512 x 5 ms = 2.56 s < 3 x 0.9 s: started at an update, a group is trained by the third update at the latest,
    # every token within eta = 2; random starts waste some (the model's main figure is not a floor)
    assert waste_model(0.9, phase=0.0, groups=5_000) == 0.0 < waste_model(0.9, groups=5_000)
