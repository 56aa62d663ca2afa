"""Control plane against strict engines: pause -> update_weights -> resume across 4 in-process synthetic engines that
behave like SGLang 0.5.23 (/health_generate blocks while paused or updating, then 503), under load, with a weight
load of several seconds, in each pause mode. Per mode: control time excluding the load (<= 50 ms), engines evicted
(0) and requests lost or failed (0). The pool health-checks every 0.2 s with a 0.5 s timeout, so each engine fails
several checks during every load: only the pool knowing that the fleet paused it keeps it in routing.

  python -m bench.engine_control [--repeat N] [--load-s S]
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/engine_control.py`: the repository root on sys.path)

import argparse
import asyncio
import logging
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.common import print_summary
from bench.results import add_results_arg, write_results
from rollq.engine.fleet import FleetController
from rollq.engine.pool import EnginePool, PoolConfig
from rollq.engine.server.app import EngineServerConfig, serve
from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig
from rollq.engine.types import ModelRequest, PauseMode, SamplingParams

MODES: tuple[PauseMode, ...] = ("abort", "retract", "in_place")


class _Evictions(logging.Handler):
    """Counts the pool's "leaves routing" warnings (every eviction logs one)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "leaves routing" in record.getMessage():
            self.count += 1


async def _one_mode(
    mode: PauseMode, repeat: int, weights: Path, *, engines: int, load_s: float, per_engine: int, max_new: int
) -> dict[str, Any]:
    # health_timeout_s: SGLang's is 20 s
    config = EngineServerConfig(port=0, weight_version="0", health_timeout_s=1.0, weights_root=str(weights))
    handles = [
        await serve(SyntheticBackend(SyntheticConfig(load_delay_s=load_s, per_token_latency_s=0.005)), config)
        for _ in range(engines)
    ]
    pool = EnginePool(PoolConfig(urls=[h.url for h in handles], health_interval_s=0.2, health_timeout_s=0.5))
    await pool.start()
    fleet = FleetController(pool)
    evictions = _Evictions()
    logging.getLogger("rollq.engine").addHandler(evictions)
    stop = asyncio.Event()
    warm = asyncio.Event()
    done = lost = failed = 0
    lanes = engines * per_engine

    async def lane(i: int) -> None:
        nonlocal done, lost, failed
        n = 0
        while not stop.is_set():
            n += 1
            req = ModelRequest(
                input_ids=[5, 6, i, n % 97],
                sampling=SamplingParams(max_new_tokens=max_new, ignore_eos=True),
                affinity=f"lane-{i}",
            )
            try:
                resp = await pool.agenerate(req)
            except Exception:
                failed += 1
                continue
            if len(resp.output_tokens) == max_new:
                done += 1
            else:
                lost += 1
            if done >= lanes:
                warm.set()

    runners = [asyncio.create_task(lane(i)) for i in range(lanes)]
    cycles: list[dict[str, float]] = []
    try:
        await asyncio.wait_for(warm.wait(), 60)  # every lane in flight, in steady state
        for v in range(1, repeat + 1):
            cycles.append(await fleet.cycle(str(weights), v, mode=mode))
        stop.set()
        await asyncio.wait_for(asyncio.gather(*runners), 120)
    finally:
        stop.set()
        logging.getLogger("rollq.engine").removeHandler(evictions)
        await pool.close()
        for h in handles:
            await h.close()
    control_ms = [1000 * c["control_s"] for c in cycles]
    return {
        "mode": mode,
        "cycles": len(cycles),
        "control_ms_median": round(statistics.median(control_ms), 2),
        "control_ms_max": round(max(control_ms), 2),
        "load_ms_median": round(1000 * statistics.median(c["load_s"] for c in cycles), 1),
        "total_ms_median": round(1000 * statistics.median(c["total_s"] for c in cycles), 1),
        "evictions": evictions.count,
        "stale_engines": sum(m.stale for m in pool.members.values()),
        "requests_completed": done,
        "requests_lost": lost,
        "requests_failed": failed,
    }


async def control_plane(
    repeat: int = 1, *, engines: int = 4, load_s: float = 3.0, per_engine: int = 16, max_new: int = 64
) -> dict[str, Any]:
    """pause -> update -> resume, `repeat` times per pause mode, on fresh strict engines for each mode."""
    with tempfile.TemporaryDirectory(prefix="rollq-bench-control-") as tmp:
        weights = Path(tmp) / "weights"
        weights.mkdir()
        modes = [
            await _one_mode(
                mode, repeat, weights, engines=engines, load_s=load_s, per_engine=per_engine, max_new=max_new
            )
            for mode in MODES
        ]
    targets = {
        "control_ms<=50": all(m["control_ms_median"] <= 50 for m in modes),
        "evictions==0": all(m["evictions"] == 0 and m["stale_engines"] == 0 for m in modes),
        "lost==0": all(m["requests_lost"] == 0 and m["requests_failed"] == 0 for m in modes),
    }
    return {"engines": engines, "load_s": load_s, "modes": modes, "targets": targets}


def table(out: dict[str, Any]) -> str:
    head = f"{'mode':<9} {'cycles':>6} {'control ms':>17} {'load ms':>8} {'evicted':>7} {'stale':>5} {'done':>6} "
    head += f"{'lost':>4} {'failed':>6}"
    rows = [head, "-" * len(head)]
    for m in out["modes"]:
        control = f"{m['control_ms_median']:.1f} (max {m['control_ms_max']:.1f})"
        rows.append(
            f"{m['mode']:<9} {m['cycles']:>6} {control:>17} {m['load_ms_median']:>8.0f} {m['evictions']:>7} "
            f"{m['stale_engines']:>5} {m['requests_completed']:>6} {m['requests_lost']:>4} {m['requests_failed']:>6}"
        )
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=1, help="cycles per pause mode")
    p.add_argument("--load-s", type=float, default=3.0, help="simulated weight load, seconds")
    add_results_arg(p)
    args = p.parse_args()
    out = asyncio.run(control_plane(args.repeat, load_s=args.load_s))
    print(
        f"pause -> update -> resume on {out['engines']} strict engines, {out['load_s']:.1f} s weight load, under load"
    )
    print(table(out))
    print("targets: control <= 50 ms, 0 evictions, 0 lost:", out["targets"])
    print_summary(out)
    write_results("engine_control", out, args.results)
    return 0 if all(out["targets"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
