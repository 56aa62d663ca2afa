"""rollq/child_errors.py: the ERROR records of children's logs as a few console lines, each distinct error once, then
counts at 10, 100, ... and a summary. The logs are written by Python's logging in the format every `rollq` process
uses (rollq/cli.py), into real files, a record at a time as a child writes them."""

from __future__ import annotations

import logging
from pathlib import Path

from rollq.child_errors import ChildErrors

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # rollq/cli.py's


def child_logger(path: Path, name: str) -> logging.Logger:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(FORMAT))
    logger = logging.getLogger(f"test-child-errors.{name}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger


def fail_a_step(logger: logging.Logger, batch: int) -> None:
    try:
        raise AttributeError(f"'collections.defaultdict' object has no attribute 'ndim' (batch {batch})")
    except AttributeError:
        logger.exception("reference engine step failed; aborting the running batch")


def test_each_distinct_error_is_one_line_then_counts_and_a_summary(tmp_path: Path) -> None:
    engine_log, worker_log = tmp_path / "engine-0.log", tmp_path / "worker-0.log"
    engine, worker = child_logger(engine_log, "engine"), child_logger(worker_log, "worker")
    logs = {"engine-0": engine_log, "worker-0": worker_log}
    errors = ChildErrors(max_distinct=3)
    engine.info("engine (ReferenceBackend) serving on http://127.0.0.1:30000")
    assert errors.poll(logs) == [] and errors.poll(logs) == []  # INFO lines are not errors

    fail_a_step(engine, 0)
    # The record ends when the next one begins, or when a poll finds its log quiet: its traceback is whole then.
    assert errors.poll(logs) == []
    first = (
        "engine-0: reference engine step failed; aborting the running batch: AttributeError: 'collections."
        f"defaultdict' object has no attribute 'ndim' (batch 0) (test-child-errors.engine; {engine_log})"
    )
    assert errors.poll(logs) == [first]

    for batch in range(1, 120):  # the same error, its numbers aside: counted, not repeated
        fail_a_step(engine, batch)
        engine.info("step %d", batch)
    worker.error("dead-lettering job entry 1764-%d: EngineUnavailable: HTTP 500: engine error", 3)
    worker.warning("request r-1 failed over")  # not an error, and the end of the one before
    lines = errors.poll(logs)
    assert [line.split(" came ")[-1] for line in lines[:2]] == ["10 times so far", "100 times so far"], lines
    assert all(line.startswith('engine-0: "reference engine step failed; aborting the') for line in lines[:2])
    assert all(line.endswith(f'..." came {n} times so far') for line, n in zip(lines, (10, 100), strict=False))
    assert lines[2:] == [
        "worker-0: dead-lettering job entry 1764-3: EngineUnavailable: HTTP 500: engine error "
        f"(test-child-errors.worker; {worker_log})"
    ]

    for i in range(4):  # distinct errors beyond max_distinct: one line says where the rest are
        engine.error("other error %s", "abcd"[i])
    assert errors.poll(logs) == [
        f"engine-0: other error a (test-child-errors.engine; {engine_log})",
        f"engine-0: other error b (test-child-errors.engine; {engine_log})",
        f"engine-0: more than 3 distinct ERROR lines; the rest are in {engine_log}",
    ]
    assert errors.poll(logs) == []  # "other error d", ended by a quiet poll: past the limit, counted only
    assert errors.summary() == [
        f"engine-0 logged 124 ERROR lines (5 distinct): {engine_log}",
        f"worker-0 logged 1 ERROR line (1 distinct): {worker_log}",
    ]


def test_a_record_written_in_pieces_is_read_whole(tmp_path: Path) -> None:
    log = tmp_path / "engine-0.log"
    errors = ChildErrors()
    with open(log, "w") as f:  # a line-buffered child may be read between its lines, or mid-line
        f.write("2026-11-28 07:00:00,000 ERROR rollq.engine: engine step failed; abort")
        f.flush()
        assert errors.poll({"engine-0": log}) == []
        f.write("ing the running batch\nTraceback (most recent call last):\n")
        f.flush()
        assert errors.poll({"engine-0": log}) == []
        f.write('  File "x.py", line 1, in run\nValueError: boom\n2026-11-28 07:00:01,000 INFO rollq.engine: ok\n')
    assert errors.poll({"engine-0": log}) == [
        f"engine-0: engine step failed; aborting the running batch: ValueError: boom (rollq.engine; {log})"
    ]
