"""A step's weight-update fields (issue 46): what the update shipped (full, delta, adapter), its bytes, preparation and
the requests it aborted or retracted, in metrics.jsonl and on the trainer's Prometheus /metrics; metrics.jsonl files
written before these fields still read and plot."""

from __future__ import annotations

import io
from pathlib import Path

import msgspec
import pytest

from rollq.engine.pool import EnginePool, PoolConfig
from rollq.trainer.metrics import MetricsLog, StepRecord, plot_run, update_fields
from rollq.trainer.prometheus_metrics import TrainerMetrics

# Two lines of a metrics.jsonl as the trainer wrote them before issue 46 (commit df5b648: no publish_s, no sync,
# bytes, prepare or request counts).
OLD_LINE = (
    '{"step":1,"version":1,"reward_mean":0.5,"reward_max":1.0,"reward_min":0.0,"samples":8,"trained_samples":8,'
    '"groups":["g0","g1"],"dropped":{},"dropped_this_step":{},"staleness_mean":0.5,"staleness_max":1,'
    '"staleness_hist":{"0":4,"1":4},"trained_tokens":64,"masked_tokens":0,"dropped_tokens":0,'
    '"trained_sample_tokens":0,"generated_tokens":0,"partial_groups":0,"split_parts":0,"late_samples":0,'
    '"paced_s":0.0,"admission_lag_mean":0.0,"queue_s_mean":0.0,"gen_tokens_per_s":120.0,"samples_per_s":4.0,'
    '"collect_s":1.5,"train_s":0.5,"step_s":2.25,"pause_s":0.125,"weight_load_s":0.0625,"ledger_version":1,'
    '"ledger_admitted":16,"ledger_limit":24,"elapsed_s":2.25,"time":1764000000.0,"train":{"loss":0.25,'
    '"clip_fraction":0.0,"capped_fraction":0.0,"importance_mean":1.0,"grad_norm":0.5,"behav_prox_gap":0.0},'
    '"filtered_groups":0,"filtered_samples":0}'
)
OLD_LINES = [OLD_LINE, OLD_LINE.replace('"step":1,"version":1', '"step":2,"version":2')]
NEW_FIELDS = (
    "sync",
    "bytes_sent",
    "bytes_per_engine",
    "prepare_s",
    "delta_share",
    "full_engines",
    "aborted_requests",
    "retracted_requests",
)


def record(step: int, **update: object) -> StepRecord:
    old = msgspec.json.decode(OLD_LINES[0].encode())
    return msgspec.convert({**old, "step": step, "version": step, **update}, StepRecord)


def test_a_metrics_file_written_before_the_update_fields_reads_and_plots(tmp_path: Path) -> None:
    # a run resumed after the upgrade: old lines, then one with the new fields
    new = record(3, sync="delta", bytes_sent=2_000_000, bytes_per_engine=1_000_000, retracted_requests=5)
    lines = [line.encode() for line in OLD_LINES] + [msgspec.json.encode(new)]
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    records = MetricsLog(tmp_path).read()
    assert [r.step for r in records] == [1, 2, 3]
    for old in records[:2]:  # read as a full update with nothing counted
        assert (old.sync, old.bytes_sent, old.prepare_s, old.aborted_requests, old.retracted_requests) == (
            "full",
            0,
            0.0,
            0,
            0,
        )
        assert old.publish_s == 0.0 and old.pause_s == 0.125
    assert (records[2].sync, records[2].bytes_per_engine, records[2].retracted_requests) == ("delta", 1_000_000, 5)
    png = plot_run(tmp_path)  # what `rollq plot RUN_DIR` draws
    assert png == tmp_path / "plot.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "phases, adapter, expected",
    [
        # a full update of today's run_cycle: no bytes or prepare keys yet, the counts read from the engines
        ({"paused_s": 0.2, "aborted": 0.0, "retracted": 7.0}, False, {"sync": "full", "retracted_requests": 7}),
        (  # a delta to two engines, one of them given full weights
            {"delta": 1.0, "bytes_sent": 3e6, "bytes_per_engine": 1.5e6, "prepare_s": 0.4, "delta_share": 0.02}
            | {"full_engines": 1.0, "aborted": 2.0},
            False,
            {"sync": "delta", "bytes_sent": 3_000_000, "bytes_per_engine": 1_500_000, "prepare_s": 0.4}
            | {"delta_share": 0.02, "full_engines": 1, "aborted_requests": 2},
        ),
        (  # a delta too big to pay: sent in full, and the share says why
            {"delta": 0.0, "bytes_sent": 8e6, "bytes_per_engine": 4e6, "delta_share": 0.9, "full_engines": 2.0},
            False,
            {"sync": "full", "bytes_sent": 8_000_000, "bytes_per_engine": 4_000_000, "delta_share": 0.9}
            | {"full_engines": 2},
        ),
        ({"total_s": 0.1, "paused_s": 0.0}, True, {"sync": "adapter"}),  # a LoRA run's adapter load
    ],
)
def test_a_steps_update_fields_come_from_the_publish_phases(phases, adapter, expected) -> None:
    fields = update_fields(phases, adapter=adapter)
    assert set(fields) == set(NEW_FIELDS) and set(NEW_FIELDS) <= set(StepRecord.__struct_fields__)
    zero = {"bytes_sent": 0, "bytes_per_engine": 0, "prepare_s": 0.0, "delta_share": 0.0, "full_engines": 0}
    assert fields == {**zero, "aborted_requests": 0, "retracted_requests": 0, **expected}
    assert msgspec.convert({**msgspec.to_builtins(record(1)), **fields}, StepRecord).sync == expected["sync"]


async def test_the_trainer_serves_the_update_fields_on_prometheus(make_train_config, tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "run", out=io.StringIO())
    pool = EnginePool(PoolConfig(urls=[]))
    metrics = TrainerMetrics(make_train_config(), pool, log)
    delta = {"sync": "delta", "bytes_sent": 3000, "bytes_per_engine": 1500, "prepare_s": 0.2, "delta_share": 0.02}
    log.write(record(1, **delta, retracted_requests=4))
    log.write(record(2, sync="full", bytes_sent=80_000, bytes_per_engine=40_000, delta_share=0.9, aborted_requests=3))
    log.write(record(3, **delta, retracted_requests=2))
    value = metrics.registry.get_sample_value
    assert value("rollq_weight_updates_total", {"kind": "delta"}) == 2
    assert value("rollq_weight_updates_total", {"kind": "full"}) == 1
    assert value("rollq_weight_updates_total", {"kind": "adapter"}) == 0  # served before any
    assert value("rollq_weight_sent_bytes_total", {"kind": "delta"}) == 6000
    assert value("rollq_weight_sent_bytes_total", {"kind": "full"}) == 80_000
    assert value("rollq_weight_update_bytes_per_engine") == 1500  # the last update's
    assert value("rollq_weight_delta_share") == 0.02
    assert value("rollq_weight_prepare_seconds_count") == 3
    assert value("rollq_weight_prepare_seconds_sum") == pytest.approx(0.4)
    assert value("rollq_weight_update_aborted_requests_total") == 3
    assert value("rollq_weight_update_retracted_requests_total") == 6
    await pool.close()
