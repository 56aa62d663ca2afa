"""A model of what the exact bound wastes on a long-tail workload at a step period, with nothing but physics in it (no
queueing, no engine limit, training that takes no time), to set the measured waste of bench/async_rl.py against.

Model: every group's G samples start together, at a random point of a period (or at `phase` of it); weights of
version k are served from k * T; sample i decodes L_i tokens (Pareto(xmin, alpha) capped) one per `token_latency`;
a token's version is the one served when it was generated. A group is trained as soon as its longest sample is done,
by the step whose weights publish next (policy version j = ceil(done / T) - 1), and a token is wasted when j - its
version > eta. `own=True` trains each sample when it alone is done instead (split_groups): the part of the waste a
group's long member causes its short members (their tokens age while it finishes) is what separates the two.

It is not a floor: the start phase matters (at T = 0.9 s a group started just after an update never passes the
bound, as 512 tokens x 5 ms < 3 periods), and a scheduler whose admissions follow the updates does better than
random starts.

    python -m bench.staleness_model          # the table for bench.async_rl's workload, JSON last
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/staleness_model.py`: the repository root on sys.path)

import argparse
import json
import math
import random

from bench.results import add_results_arg, write_results


def waste_model(
    step_s: float,
    *,
    eta: int = 2,
    token_latency: float = 0.005,
    xmin: float = 16.0,
    alpha: float = 1.2,
    cap: int = 512,
    group_size: int = 8,
    groups: int = 50_000,
    own: bool = False,
    phase: float | None = None,
    seed: int = 0,
) -> float:
    """Fraction of generated tokens older than v - eta when trained, at a weight update every `step_s` seconds;
    groups start at a random point of the period, or at `phase` (0: right after an update)."""
    rng = random.Random(seed)
    generated = wasted = 0
    for _ in range(groups):
        start = rng.uniform(0.0, step_s) if phase is None else phase * step_s
        lengths = [min(cap, max(1, int(xmin * (1.0 - rng.random()) ** (-1.0 / alpha)))) for _ in range(group_size)]
        group_done = start + max(lengths) * token_latency
        for n in lengths:
            done = start + n * token_latency if own else group_done
            trained_at = math.ceil(done / step_s) - 1
            # token k (1..n) is generated at start + k * latency; it is too old when generated before (j - eta) * T
            horizon = (trained_at - eta) * step_s - start
            old = 0 if horizon <= 0 else min(n, math.ceil(horizon / token_latency) - 1)
            generated += n
            wasted += max(0, old)
    return wasted / generated


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eta", type=int, default=2)
    p.add_argument("--sync-samples-per-s", type=float, default=23.9, help="eta = 0 throughput, for the speedup column")
    p.add_argument("--batch", type=int, default=64)
    add_results_arg(p)
    args = p.parse_args(argv)
    rows = []
    print("| step period s | speedup at that period | whole groups | each sample alone | groups started at an update |")
    print("|---:|---:|---:|---:|---:|")
    for step_s in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.5):
        group, alone = waste_model(step_s, eta=args.eta), waste_model(step_s, eta=args.eta, own=True)
        at_update = waste_model(step_s, eta=args.eta, phase=0.0)
        speedup = args.batch / step_s / args.sync_samples_per_s
        rows.append(
            {
                "step_s": step_s,
                "speedup": round(speedup, 2),
                "groups": round(group, 4),
                "own": round(alone, 4),
                "groups_at_update": round(at_update, 4),
            }
        )
        print(f"| {step_s:.1f} | {speedup:.2f}x | {group:.1%} | {alone:.1%} | {at_update:.1%} |")
    summary = {"bench": "staleness_model", "eta": args.eta, "rows": rows}
    print(json.dumps(summary))
    write_results("staleness_model", summary, args.results, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
