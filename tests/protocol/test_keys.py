import pytest

from rollq.protocol.keys import RunKeys, consumed_key, inflight_key


def test_every_key_of_a_run_shares_one_hash_tag():
    keys = RunKeys("exp-1")
    names = [keys.jobs, keys.results, keys.dead, keys.workers, keys.job_seen("abc"), keys.reply_stream("cli")]
    names += [inflight_key(keys.results), consumed_key(keys.results, "trainer", "abc")]
    assert all(name.startswith("rollq:{exp-1}:") for name in names)
    assert keys.owns(keys.reply_stream("x")) and not RunKeys("other").owns(keys.results)


@pytest.mark.parametrize("bad", ["", "a}b", "a{b", "a:b", "x" * 65, "sp ace"])
def test_run_names_that_would_break_the_hash_tag_are_rejected(bad):
    with pytest.raises(ValueError, match="run name"):
        RunKeys(bad)


def test_job_streams_are_named_once_for_class_and_partition():
    keys = RunKeys("exp-1")
    assert keys.job_stream() == keys.jobs == "rollq:{exp-1}:jobs"  # the default class keeps today's key
    assert keys.job_stream("eval") == "rollq:{exp-1}:jobs:eval"
    assert keys.at(3).job_stream("eval") == "rollq:{exp-1/p3}:jobs:eval"  # a partition has a hash tag of its own
    assert keys.at(2).job_stream("train") == "rollq:{exp-1/p2}:jobs"
    assert keys.classes == "rollq:{exp-1}:classes"
    with pytest.raises(ValueError, match="job class"):
        keys.job_stream("a:b")
