"""rollq.local.free_port with ROLLQ_LOCAL_PORTS (what the suite itself runs with, tests/conftest.py): ports of the
range handed out in turn, across concurrent processes too, skipping ones in use; a bad range is a clear error. Each
test has a range of its own, outside the suite's (10000-19999), its cluster bus ports and the ephemeral range."""

import json
import os
import socket
import subprocess
import sys

import pytest

from rollq.local import HOST, PORT_RANGE_ENV, LocalError, free_port


def test_the_suite_runs_with_a_range_of_its_own():
    assert PORT_RANGE_ENV in os.environ  # set by tests/conftest.py before any test process starts
    assert 10000 <= free_port() <= 65535


def test_concurrent_processes_never_get_the_same_port(monkeypatch):
    monkeypatch.setenv(PORT_RANGE_ENV, "30000-30999")
    script = "import json; from rollq.local import free_port; print(json.dumps([free_port() for _ in range(60)]))"
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE) for _ in range(4)]
    picked = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        picked += json.loads(out)
    assert len(picked) == 240 and len(set(picked)) == 240  # none twice: random picks in 1000 would repeat 1 in 10^12
    assert all(30000 <= p <= 30999 for p in picked)


def test_ports_come_in_turn_skipping_taken_and_listened_ones_and_wrap(monkeypatch):
    monkeypatch.setenv(PORT_RANGE_ENV, "30990-30993")
    first = free_port()
    following = [free_port() for _ in range(3)]
    assert sorted([first, *following]) == [30990, 30991, 30992, 30993]  # each once, in turn
    assert free_port() == first  # wrapped around
    with socket.socket() as listener:
        nxt = following[0]
        listener.bind((HOST, nxt))
        listener.listen()
        assert free_port(taken={following[1]}) == following[2]  # in use, taken: both passed over


@pytest.mark.parametrize("spec", ["20000", "x-y", "30000-20000", "80-90", "30000-70000"])
def test_a_bad_range_names_the_setting(monkeypatch, spec):
    monkeypatch.setenv(PORT_RANGE_ENV, spec)
    with pytest.raises(LocalError, match=PORT_RANGE_ENV):
        free_port()


def test_a_range_with_every_port_in_use_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(PORT_RANGE_ENV, "30980-30981")
    with socket.socket() as a, socket.socket() as b:
        a.bind((HOST, 30980))
        b.bind((HOST, 30981))
        with pytest.raises(LocalError, match="no free port in"):
            free_port()
