"""docs/benchmarks.md and the README's headline, rendered from the benchmarks' results files (bench/results/*.json).

    python -m bench.report            # rewrite docs/benchmarks.md and the README block between its markers
    python -m bench.report --check    # exit 1 when either differs from what the results files render

Each benchmark writes `bench/results/<bench>.json` (bench/results.py): its JSON summary with the command, date,
commit and machine. Every table on the page comes from one of those files through a small spec below (which summary
fields become which columns), and states that provenance under it; no figure is typed by hand. The rendering is
deterministic (same files, same page), so a test can fail when the committed page or README block drifts.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/report.py`: the repository root on sys.path)

import argparse
import difflib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.results import REPO, RESULTS_DIR

PAGE = REPO / "docs" / "benchmarks.md"
README = REPO / "README.md"
START, END = "<!-- bench:headline:start -->", "<!-- bench:headline:end -->"
DASH = "—"

Record = dict[str, Any]
Fmt = Callable[[Any], str]


# -- values and formats ------------------------------------------------------------------------------------------


def get(data: Any, path: str) -> Any:
    """The value at a '/'-separated path (list items by index); None where any step is missing."""
    for key in filter(None, path.split("/")):
        if isinstance(data, Mapping):
            data = data.get(key)
        elif isinstance(data, Sequence) and not isinstance(data, str) and key.lstrip("-").isdigit():
            i = int(key)
            data = data[i] if -len(data) <= i < len(data) else None
        else:
            return None
    return data


def _none(fmt: Fmt) -> Fmt:
    return lambda v: DASH if v is None else fmt(v)


def text(v: Any) -> str:
    return DASH if v is None else str(v)


def num(nd: int = 0) -> Fmt:
    return _none(lambda v: f"{v:,.{nd}f}")


def pct(nd: int = 1) -> Fmt:
    """A fraction as a percentage: 0.027 -> 2.7%."""
    return _none(lambda v: f"{100 * v:.{nd}f}%")


def times(nd: int = 2) -> Fmt:
    return _none(lambda v: f"{v:,.{nd}f}x")


def signed(nd: int = 2, unit: str = "") -> Fmt:
    return _none(lambda v: f"{v:+.{nd}f}{unit}")


def yesno(v: Any) -> str:
    return DASH if v is None else ("yes" if v else "**no**")


def met(v: Any) -> str:
    return DASH if v is None else ("met" if v else "**missed**")


def hist(v: Any) -> str:
    return DASH if not v else ", ".join(f"{k}: {n:,}" for k, n in v.items())


def counts(v: Any) -> str:
    """Counts by reason ({'stale': 120} -> 'stale 120'), none -> 0."""
    if v is None:
        return DASH
    if isinstance(v, Mapping):
        return ", ".join(f"{k} {n:,}" for k, n in v.items()) or "0"
    return f"{v:,}"


def joined(fmt: Fmt, sep: str = ", ") -> Fmt:
    return _none(lambda v: sep.join(fmt(x) for x in v))


def cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


# -- specs ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Col:
    """A column: its header, the path of its value in the row ('' = the row itself) and its format."""

    head: str
    path: str = ""
    fmt: Fmt = text
    left: bool = False


@dataclass(frozen=True)
class Table:
    """Rows from the summary: `rows` is the path of a dict (one row per item, its key the label; only the keys
    `labels` names where it names any), of a list (no label column: a Col gives the label), fixed (label, path)
    pairs, or a function of the summary returning such a dict or list."""

    caption: str
    rows: str | tuple[tuple[str, str], ...] | Callable[[Any], Any]
    cols: tuple[Col, ...]
    label: str = ""  # header of the label column (dict or fixed rows)
    labels: Mapping[str, str] = field(default_factory=dict)  # a dict's keys to show, in order, and their labels
    root: str = ""  # the path the rows are under (a part of a bench that also runs alone)


@dataclass(frozen=True)
class Line:
    """A sentence of figures under the tables: `render(summary)` -> text ('' leaves it out)."""

    render: Callable[[Any], str]


@dataclass(frozen=True)
class Bench:
    name: str  # results file stem: bench/results/<name>.json
    title: str
    about: str  # what is measured, how: no figures
    tables: tuple[Table, ...] = ()
    lines: tuple[Line, ...] = ()
    targets: str = "targets"  # path of a {name: bool} dict of the bench's targets ('' = none)
    missing: str = "not run: no results file yet"  # the page's line when there is no results file
    optional: bool = False  # a standalone run of a part of another bench: no section unless its file exists


@dataclass(frozen=True)
class Headline:
    """A row of the README's headline: a figure from one bench's summary, and what it is held to."""

    bench: str
    what: str
    value: Callable[[Any], str]
    target: str


# -- the benches ---------------------------------------------------------------------------------------------------


def _async_recommended(s: Any, key: str) -> Any:
    return get(s, f"waste/{get(s, 'waste_targets/variant')}/{key}")


def _rounds(s: Any) -> dict[str, Any]:
    """async_rl's per-round rows: '<variant>, round N' -> that round's measurements."""
    out: dict[str, Any] = {}
    for variant in get(s, "rounds/0") or {}:
        for i, rnd in enumerate(get(s, "rounds") or []):
            out[f"{variant}, round {i + 1}"] = rnd[variant]
    return out


ENGINE_TABLES = {
    "a": Table(
        "(a) reference engine: continuous batching vs sequential `model.generate`",
        (("batched", ""),),
        (
            Col("concurrency", "concurrency", num()),
            Col("new tokens", "max_new_tokens", num()),
            Col("batched tok/s", "batched_tok_s", num()),
            Col("sequential tok/s", "sequential_tok_s", num()),
            Col("ratio (target >= 5x)", "ratio", times()),
            Col("greedy outputs identical", "greedy_equal"),
            Col("torch threads", "torch_threads", num()),
        ),
        label="run",
    ),
    "b": Table(
        "(b) EnginePool vs a bare SGLangClient, synthetic engine",
        (("pool vs bare", ""),),
        (
            Col("open-loop rate req/s", "rate_rps", num()),
            Col("p50 bare ms", "bare_p50_ms", num(3)),
            Col("p50 pool ms", "pool_p50_ms", num(3)),
            Col("latency overhead (target <= 5%)", "latency_overhead_pct", signed(1, "%")),
            Col(
                "saturation req/s bare / pool", "", lambda r: f"{num()(r.get('bare_rps'))} / {num()(r.get('pool_rps'))}"
            ),
            Col(
                "client CPU µs/req bare / pool",
                "",
                lambda r: f"{num()(r.get('bare_cpu_us'))} / {num()(r.get('pool_cpu_us'))}",
            ),
        ),
        label="",
    ),
    "c": Table(
        "(c) pause -> update_weights -> resume on strict engines under load, per pause mode",
        "modes",
        (
            Col("mode", "mode", left=True),
            Col("cycles", "cycles", num()),
            Col("control ms, median (target <= 50)", "control_ms_median", num(1)),
            Col("control ms, max", "control_ms_max", num(1)),
            Col("weight load ms", "load_ms_median", num()),
            Col("evictions", "evictions", num()),
            Col("requests completed", "requests_completed", num()),
            Col("lost", "requests_lost", num()),
            Col("failed", "requests_failed", num()),
        ),
    ),
    "d": Table(
        "(d) prefix cache vs none, reference engine, GRPO groups",
        (("cache", "cache"), ("no cache", "no_cache")),
        (
            Col("generated tok/s", "gen_tokens_per_s", num()),
            Col("seconds per round", "seconds", num(2)),
            Col("prefill tokens", "prefill_tokens", num()),
            Col("cached tokens", "cached_tokens", num()),
            Col("generated tokens", "generated_tokens", num()),
        ),
        label="mode",
    ),
    "e": Table(
        "(e) weight update, disk vs distributed (gloo), on this host",
        "rows",
        (
            Col("model", "model", left=True),
            Col("engines", "engines", num()),
            Col("parameters", "params", num()),
            Col("disk s", "disk_s", num(3)),
            Col("disk bytes moved", "disk_bytes_moved", num()),
            Col("distributed s", "distributed_s", num(3)),
            Col("distributed s, cold", "distributed_cold_s", num(3)),
            Col("distributed bytes moved", "distributed_bytes_moved", num()),
            Col("disk / distributed", "speedup", times(1)),
        ),
    ),
}


def _engine_part(part: str, root: str) -> Table:
    """`bench.engine`'s table of a part, for the part's key in engine.json or for its own results file ('')."""
    return replace(ENGINE_TABLES[part], root=root)


def _queue_line(s: Any) -> str:
    cpu = get(s, "systems/rollq/cpu_us_per_traj") or {}
    runs = get(s, "systems/rollq/all_traj_per_s")
    return (
        f"rollq CPU per trajectory: worker {num()(cpu.get('worker'))} µs, producer + consumer "
        f"{num()(cpu.get('bench_process'))} µs, redis-server {num()(cpu.get('redis'))} µs"
        + (f"; rollq's runs: {joined(num())(runs)} trajectories/s (the median is tabled)." if runs else ".")
    )


def _async_line(s: Any) -> str:
    rec = get(s, "waste_targets/variant")
    return (
        f"Speed-up eta = 2 / eta = 0 (median of the rounds' ratios, `stale_policy: drop`): "
        f"**{times()(get(s, 'speedup'))}** (per round {joined(times())(get(s, 'speedup_per_round'))}; target >= "
        f"{times(0)(get(s, 'target'))}); with `mask`, oldest first: {times()(get(s, 'speedup_mask'))}. The waste "
        f"targets (<= 5% wasted at >= 3x, trained lengths within 10% of generated) are judged on `{rec}`: "
        f"**{pct()(_async_recommended(s, 'waste'))} wasted at {times()(_async_recommended(s, 'speedup'))}**; variants "
        f"meeting all three: {', '.join(f'`{v}`' for v in get(s, 'waste_targets/met_by') or []) or 'none'}. The "
        f"ledger's bound held at every step: {yesno(get(s, 'ledger_bound_held'))}; max staleness trained at eta = 2: "
        f"{get(s, 'async_staleness_max')}."
    )


def _prefix_line(d: Any) -> str:
    if d is None:
        return ""
    return (
        f"(d) generated tokens/s with the cache / without: **{times()(d.get('speedup'))}** (target >= 2x); prefill "
        f"tokens {times(1)(d.get('prefill_ratio'))} fewer."
    )


def _tracing_bench(name: str, title: str, about: str) -> Bench:
    def paired(s: Any) -> str:
        each = {b: ", ".join(f"{r:.3f}" for r in get(s, f"{b}_vs_none_each") or []) for b in ("off", "on")}
        return (
            f"Steady state (after {num()(get(s, 'warmup_samples'))} of {num()(get(s, 'samples'))} samples), paired "
            f"with `none`, median over {get(s, 'rounds')} rounds: off {num(3)(get(s, 'off_vs_none'))} "
            f"({each['off']}), on {num(3)(get(s, 'on_vs_none'))} ({each['on']}); whole measures, warm-up included: "
            f"off {num(3)(get(s, 'off_vs_none_whole'))}, on {num(3)(get(s, 'on_vs_none_whole'))}; off within 1 %: "
            f"{yesno(get(s, 'off_within_1pct'))}, on within 3 %: {yesno(get(s, 'on_within_3pct'))}. Sample rate "
            f"when on: {num(2)(get(s, 'sample_rate') or 1.0)}; spans received: {num()(get(s, 'spans_received'))} "
            f"({num(3)(get(s, 'received_share'))} of every sample's; below the rate: dropped by the SDK's full queue)."
        )

    return Bench(
        name,
        title,
        about,
        (
            Table(
                "Throughput and the worker's CPU",
                (("none", "builds/none"), ("off", "builds/off"), ("on", "builds/on")),
                (
                    Col("samples/s, steady (median)", "samples_per_s", num(1)),
                    Col("warm-up s", "warmup_s", num(2)),
                    Col("samples/s, whole measure", "whole_samples_per_s", num(1)),
                    Col("worker CPU us/sample, steady", "worker_cpu_us_per_sample", num()),
                ),
                label="build",
            ),
        ),
        (Line(paired),),
        targets="",
    )


def _trainer_tables(gpu: bool) -> tuple[Table, ...]:
    """bench.trainer's tables: memory per rank at the end of each phase, then rank 0's times and the losses."""
    phases = joined(num(), " / ")
    memory: tuple[Col, ...] = (
        Col("threads", "threads", num()),
        Col("parameters + gradients + AdamW state", "bytes_mib", joined(num(1), " / ")),
        Col("vs 1 rank, after the steps (target <= 0.55x)", "vs_1_rank", times(3)),
        Col("RSS", "rss_mib", phases),
        Col("peak RSS during the phase", "peak_rss_mib", phases),
    )
    if gpu:
        memory += (
            Col("CUDA allocated", "cuda_mib", phases),
            Col("CUDA peak during the phase", "cuda_peak_mib", phases),
        )
    return (
        Table("Memory per rank, MiB, where each phase ends: load / steps / publish / checkpoint", "memory", memory),
        Table(
            "Times, s (rank 0's wall clock), and the loss of each step on the fixed batch",
            "timing",
            (
                Col("load", "load_s", num(2)),
                Col("step, median", "step_s_median", num(2)),
                Col("publish (save_weights)", "publish_s", num(2)),
                Col("published MiB", "publish_mib", num()),
                Col("checkpoint save", "checkpoint_save_s", num(2)),
                Col("checkpoint load", "checkpoint_load_s", num(2)),
                Col("checkpoint MiB", "checkpoint_mib", num()),
                Col("loss per step", "losses", joined(num(5)), left=True),
                Col("decreasing", "loss_decreases", yesno),
            ),
            label="ranks",
        ),
    )


def _trainer_line(s: Any) -> str:
    batch = get(s, "batch") or {}
    tied = {True: "yes", False: "no"}.get(get(s, "tied_embeddings"))
    out = (
        f"`{get(s, 'model')}`, {num()(get(s, 'params'))} parameters (tied embeddings: {text(tied)}), "
        f"{get(s, 'device')} {get(s, 'compute_dtype')}; {get(s, 'steps')} AdamW steps (lr {get(s, 'lr')}) on one "
        f"global batch of {batch.get('sequences')} sequences, {num()(batch.get('tokens'))} tokens "
        f"({num()(batch.get('trained_tokens'))} trained); publish buckets of {num()(get(s, 'publish_bucket_mb'))} MiB; "
        + (
            f"glibc's mmap threshold fixed at {num()(get(s, 'malloc_mmap_threshold'))} bytes."
            if get(s, "malloc_mmap_threshold") is not None
            else "glibc's own (dynamic) mmap threshold."
        )
    )
    if get(s, "bytes_ratio") is not None:
        out += (
            f" Parameters + gradients + AdamW state per rank, 2 ranks / 1: **{times(3)(get(s, 'bytes_ratio'))}** "
            f"(target <= 0.55x); peak RSS during the steps, 2 ranks / 1: {times(2)(get(s, 'peak_rss_ratio_steps'))}; "
            f"the losses at 2 ranks differ from 1 rank's by at most {_sci(get(s, 'loss_max_rel_diff_2_vs_1'))} "
            "(relative)."
        )
    return out


def _sci(v: Any) -> str:
    return DASH if v is None else f"{v:.1e}"


def _weight_sync_line(s: Any) -> str:
    checks = get(s, "checks/delta") or {}
    changed, changed_max = pct(2)(get(s, "changed_share")), pct(2)(get(s, "changed_share_max"))
    share, share_max = pct(2)(get(s, "delta_share")), pct(2)(get(s, "delta_share_max"))
    return (
        f"`{get(s, 'model')}`, {num()(get(s, 'params'))} parameters, lr {_sci(get(s, 'lr'))}, {get(s, 'steps')} steps "
        f"(train step {num(2)(get(s, 'train_s'))} s, generation {num(2)(get(s, 'generate_s'))} s, medians); on the "
        f"delta side {get(s, 'delta_updates')} delta updates and {get(s, 'full_updates_on_delta_side')} full ones "
        f"after version 0 (the full weights every engine starts from). Weights changed per step: {changed} (at most "
        f"{changed_max}); delta bytes / full: {share} (at most {share_max}). Engine weights bit-exact with the "
        f"trainer's: delta engine {yesno(get(s, 'bit_exact'))} (after {get(s, 'bit_exact_steps')} of "
        f"{get(s, 'steps')} steps; {get(checks, 'matched')} of {get(checks, 'tensors')} tensors at the end), full "
        f"engine {yesno(get(s, 'full_bit_exact'))}."
    )


AGENT_VARIANTS = {
    "direct": "SGLangClient -> engine /generate",
    "pool": "EnginePool.agenerate -> engine",
    "aiohttp": "aiohttp POST -> proxy -> pool -> engine",
    "responses": "aiohttp POST /v1/responses -> proxy -> ...",
    "sdk": "openai.AsyncOpenAI (httpx) -> proxy -> ...",
}
AGENT_SYSTEMS = {
    "A_rollq": "(A) rollq: producer -> Redis -> worker (proxy, OpenAI SDK inline)",
    "A_rollq_hosts": "(A-hosts) the same, agents in 2 host processes",
    "A_rollq_raw_agent": "(A-raw) the same, agent on raw aiohttp (diagnostic)",
    "A_rollq_command_agent": "(A-cmd) command agent, sh + curl, 1 model turn",
    "B_batch_sequential_tools": "(B) batch loop, tools one after another",
    "B2_batch_concurrent_tools": "(B') batch loop, tools concurrent (per-turn barriers)",
    "S_per_sample": "(S) a task per sample calling the pool (verl's AgentLoop shape)",
}
AGENT_EPISODE_COLS = (
    Col("episodes", "episodes", num()),
    Col("episodes/s", "episodes_per_s", num(2)),
    Col("seconds", "seconds", num(2)),
    Col("episode p50 s", "episode_s_p50", num(3)),
    Col("episode max s", "episode_s_max", num(3)),
    Col("worker CPU ms per model request", "worker_cpu_ms_per_request", num(2)),
    Col("with its children", "total_cpu_ms_per_request", num(2)),
)


def _sdk_rows(s: Any) -> dict[str, Any]:
    f = get(s, "sdk_floor") or {}
    return {
        label: {"per_turn": f.get(key), "mean": f.get(f"{key[:-3]}_mean_ms")}
        for label, key in (
            ("AsyncOpenAI + the shared httpx client (create + parse)", "sdk_ms"),
            ("... of which the SDK's request transform", "transform_ms"),
            ("raw aiohttp POST, the same body", "raw_aiohttp_ms"),
        )
        if key in f
    }


def _agents_line(s: Any) -> str:
    out = []
    if get(s, "proxy_overhead"):
        o = "proxy_overhead/overhead"
        out.append(
            f"1. The proxy's own overhead, p50 (aiohttp through the proxy minus direct): turn 1 "
            f"{signed(3, ' ms')(get(s, f'{o}/first/proxy_vs_direct_ms'))}, turn 2 "
            f"{signed(3, ' ms')(get(s, f'{o}/continuation/proxy_vs_direct_ms'))}; `/v1/responses` "
            f"{signed(3, ' ms')(get(s, f'{o}/first/responses_vs_direct_ms'))} / "
            f"{signed(3, ' ms')(get(s, f'{o}/continuation/responses_vs_direct_ms'))} (target <= 1.5 ms); with the "
            f"OpenAI SDK {signed(3, ' ms')(get(s, f'{o}/first/sdk_vs_direct_ms'))} / "
            f"{signed(3, ' ms')(get(s, f'{o}/continuation/sdk_vs_direct_ms'))}."
        )
    if get(s, "agent_workload"):
        out.append(
            f"2. A / B {times(1)(get(s, 'agent_workload/A_vs_B'))} (target >= 4x), A / B' "
            f"{times()(get(s, 'agent_workload/A_vs_B2'))}; the episode's floor is "
            f"{num(3)(get(s, 'agent_workload/episode_floor_s'))} s."
        )
    if get(s, "long_tail"):
        out.append(
            f"3. A / B' **{times()(get(s, 'long_tail/A_vs_B2'))}** (target >= 1.5x), A / S "
            f"{times()(get(s, 'long_tail/A_vs_per_sample'))} (target >= 0.8x); replies {get(s, 'long_tail/filler')} "
            f"filler tokens, tools {get(s, 'long_tail/tool_latency')}."
        )
    return "\n\n".join(out)


BENCHES: dict[str, Bench] = {
    b.name: b
    for b in [
        Bench(
            "queue_throughput",
            "Queue throughput: rollq vs arq vs asyncio.Queue",
            "End to end, a job in and one 1,024-token trajectory out (precomputed, no engine), so what is measured is "
            "queueing, transport and encoding: rollq (one `rollq worker` process, a producer and a consumer), arq "
            "(`enqueue_job` + an arq worker on uvloop, msgpack) and an in-process `asyncio.Queue` pipeline doing "
            "rollq's per-item work without Redis. Then the encodings of one trajectory.",
            (
                Table(
                    "End to end",
                    "systems",
                    (
                        Col("jobs", "jobs", num()),
                        Col("seconds", "seconds", num(2)),
                        Col("trajectories/s", "traj_per_s", num()),
                    ),
                    label="system",
                ),
                Table(
                    "Encodings of one trajectory (best of repeats)",
                    "encodings",
                    tuple(
                        Col(f"{head} ({n:,} tok)", f"{n}/{key}", num(nd))
                        for n in (1024, 4096)
                        for head, key, nd in (
                            ("bytes", "bytes", 0),
                            ("encode µs", "encode_us", 1),
                            ("decode µs", "decode_us", 1),
                        )
                    ),
                    label="encoding",
                ),
            ),
            (
                Line(
                    lambda s: (
                        f"rollq / arq: **{times(1)(get(s, 'rollq_vs_arq'))}**; rollq / asyncio.Queue: "
                        f"{times(2)(get(s, 'rollq_vs_asyncio_queue'))}."
                    )
                ),
                Line(_queue_line),
            ),
        ),
        Bench(
            "ingress",
            "HTTP ingress",
            "`rollq ingress` (one tenant) on a redis-server: how fast it accepts batch POSTs of small jobs with no "
            "worker running (validation, encoding, the all-or-nothing submit script, the HTTP round trip), and, with a "
            "synthetic engine and one worker, the time from a job's POST to the first `sample` event on its SSE "
            "stream, one job at a time.",
            (
                Table(
                    "Accepting jobs",
                    (("accept", "accept"),),
                    (
                        Col("jobs", "jobs", num()),
                        Col("jobs per POST", "batch", num()),
                        Col("clients", "clients", num()),
                        Col("jobs/s (target >= 5,000)", "jobs_per_s", num()),
                        Col("POST p50 ms", "post_p50_ms", num(1)),
                        Col("ingress CPU ms per 1,000 jobs", "ingress_cpu_ms_per_1k_jobs", num(1)),
                    ),
                ),
                Table(
                    "POST to the first SSE event",
                    (("first event", "first_event"),),
                    (
                        Col("jobs", "samples", num()),
                        Col("p50 ms", "p50_ms", num(2)),
                        Col("p99 ms", "p99_ms", num(2)),
                        Col("max ms", "max_ms", num(2)),
                    ),
                ),
            ),
            (Line(lambda s: f"Accept target (>= 5,000 jobs/s): {met(get(s, 'accept/meets_target'))}."),),
        ),
        Bench(
            "async_rl",
            "Asynchronous vs synchronous RL",
            "The real trainer (tiny model, GRPO + decoupled PPO on CPU, weights loaded by every engine each step) with "
            "`rollq worker` processes and synthetic engines whose output lengths are long-tailed; eta = 2 "
            "(asynchronous) against eta = 0 (synchronous) and the stale policies, scheduling, pacing, split groups "
            "and late joins in between, alternating over rounds in the same run. Throughput counts the steps after "
            "the first two. The waste table sums the rounds: tokens generated by the samples settled, trained by the "
            "loss, masked, dropped; the model column is `bench/staleness_model.py` at the variant's own step period.",
            (
                Table(
                    "Per round",
                    _rounds,
                    (
                        Col("trained samples/s", "samples_per_s", num(1)),
                        Col("step s (median)", "step_s_median", num(2)),
                        Col("train s", "train_s_median", num(2)),
                        Col("waiting for the batch s", "collect_s_median", num(2)),
                        Col("pause ms", "pause_ms_median", num()),
                        Col("staleness of trained samples (samples)", "staleness_hist", hist, left=True),
                        Col("dropped (samples, by reason)", "dropped", counts, left=True),
                    ),
                    label="variant",
                ),
                Table(
                    "Waste under the exact bound, by variant",
                    "waste",
                    (
                        Col("generated", "tokens_settled", num()),
                        Col("trained", "tokens_trained", num()),
                        Col("masked", "tokens_masked", num()),
                        Col("dropped", "tokens_dropped", num()),
                        Col("wasted", "waste", pct()),
                        Col(
                            "model (step period)",
                            "",
                            lambda w: f"{pct()(w.get('model'))} ({num(2)(w.get('step_s'))} s)",
                        ),
                        Col(
                            "mean length trained / settled",
                            "",
                            lambda w: (
                                f"{num(1)(w.get('mean_len_trained'))} / {num(1)(w.get('mean_len_settled'))} "
                                f"({num(2)(w.get('length_ratio'))})"
                            ),
                            left=True,
                        ),
                        Col("samples/s", "samples_per_s", num(1)),
                        Col("speed-up vs eta=0", "speedup", times()),
                    ),
                    label="variant",
                ),
            ),
            (Line(lambda s: f"Workload: {get(s, 'workload')}."), Line(_async_line)),
            targets="waste_targets",
        ),
        Bench(
            "staleness_model",
            "Staleness model",
            "What the exact bound would waste with nothing but physics (no queueing, no engine limit, training that "
            "takes no time) on `bench.async_rl`'s workload, by step period: groups starting at random points of the "
            "period, each sample alone (split groups), and groups started at an update. Computed, not measured; the "
            "speed-up column uses the command's eta = 0 throughput.",
            (
                Table(
                    "Wasted share of generated tokens",
                    "rows",
                    (
                        Col("step period s", "step_s", num(1)),
                        Col("speed-up at that period", "speedup", times()),
                        Col("whole groups", "groups", pct()),
                        Col("each sample alone", "own", pct()),
                        Col("groups started at an update", "groups_at_update", pct()),
                    ),
                ),
            ),
        ),
        Bench(
            "agents",
            "Agents",
            "The recording proxy's own overhead per chat completion and per Responses call; agent-episode throughput "
            "of rollq against batch loops and a per-sample loop, on a uniform and a long-tailed workload; the worker's "
            "CPU per model request against the OpenAI SDK's own. The parts are described in `bench/agents.py`'s "
            "docstring.",
            (
                Table(
                    "1. One request at a time, 2-turn conversations (turn 2 continues turn 1), latency ms",
                    "proxy_overhead/latency",
                    (
                        Col("turn 1 p50", "first/p50_ms", num(3)),
                        Col("turn 1 p90", "first/p90_ms", num(3)),
                        Col("turn 2 p50", "continuation/p50_ms", num(3)),
                        Col("turn 2 p90", "continuation/p90_ms", num(3)),
                    ),
                    label="variant",
                    labels=AGENT_VARIANTS,
                ),
                Table(
                    "2. Agent episodes: 4 model turns, 3 tool calls of fixed length",
                    "agent_workload",
                    AGENT_EPISODE_COLS,
                    label="system",
                    labels=AGENT_SYSTEMS,
                ),
                Table(
                    "3. Long tail: replies Pareto-distributed, tools lognormal",
                    "long_tail",
                    AGENT_EPISODE_COLS,
                    label="system",
                    labels=AGENT_SYSTEMS,
                ),
                Table(
                    "4. CPU per call against a trivial server, ms, by the agent's turn",
                    _sdk_rows,
                    (
                        *(Col(f"turn {i + 1}", f"per_turn/{i}", num(3)) for i in range(4)),
                        Col("mean", "mean", num(3)),
                    ),
                    label="client",
                ),
            ),
            (Line(_agents_line),),
        ),
        Bench(
            "engine",
            "Engine layer",
            "(a) the reference engine's continuous batching against sequential `model.generate`; (b) EnginePool's "
            "overhead over a bare client at a fixed open-loop rate, synthetic engine; (c) pause -> update_weights -> "
            "resume across strict engines (SGLang's health semantics) under load, per pause mode; (d) the prefix "
            "cache on GRPO groups; (e) a weight update from disk against one over a gloo process group.",
            (
                _engine_part("a", "a_batching"),
                _engine_part("b", "b_pool_overhead"),
                _engine_part("c", "c_control_plane"),
                _engine_part("d", "d_prefix_reuse"),
                _engine_part("e", "e_weight_update"),
            ),
            (Line(lambda s: _prefix_line(get(s, "d_prefix_reuse"))),),
        ),
        Bench(
            "engine_batching",
            "Engine: continuous batching (standalone)",
            "`bench.engine` part (a) run alone.",
            (_engine_part("a", ""),),
            optional=True,
        ),
        Bench(
            "engine_control",
            "Engine: control plane (standalone)",
            "`bench.engine` part (c) run alone.",
            (_engine_part("c", ""),),
            optional=True,
        ),
        Bench(
            "engine_prefix",
            "Engine: prefix cache (standalone)",
            "`bench.engine` part (d) run alone.",
            (_engine_part("d", ""),),
            optional=True,
        ),
        Bench(
            "engine_weights",
            "Engine: weight updates (standalone)",
            "`bench.engine` part (e) run alone.",
            (_engine_part("e", ""),),
            optional=True,
        ),
        Bench(
            "fair_share",
            "Job classes: fair share and priority",
            "Two backlogged classes, `train` and `ext`, filled at a submission ratio before one `rollq worker` starts: "
            "the share of the jobs started that went to `train` while both still had jobs queued, against the share "
            "their weights ask for. Then a high-priority class submitted behind a backlog: how many backlog jobs "
            "started while its jobs were starting, and its jobs' wait.",
            (
                Table(
                    "Shares",
                    "shares",
                    (
                        Col("submitted train:ext", "submitted_train_ext"),
                        Col("weights train:ext", "weights_train_ext"),
                        Col("expected train share", "expected_train_share", num(3)),
                        Col("observed", "observed_train_share", num(3)),
                        Col("relative error", "relative_error", pct()),
                        Col("jobs in the window", "window_jobs", num()),
                        Col("jobs/s", "jobs_per_s", num()),
                    ),
                ),
                Table(
                    "Priority",
                    (("eval (priority 10) behind train", "priority"),),
                    (
                        Col("backlog", "backlog", num()),
                        Col("eval jobs", "eval_jobs", num()),
                        Col("backlog queued when eval arrived", "bulk_queued_when_eval_arrived", num()),
                        Col(
                            "backlog jobs started between the first and last eval start",
                            "bulk_started_between_first_and_last_eval",
                            num(),
                        ),
                        Col("eval wait p50 ms", "eval_wait_p50_ms", num(1)),
                        Col("eval wait max ms", "eval_wait_max_ms", num(1)),
                    ),
                ),
            ),
        ),
        Bench(
            "partitions",
            "Partitions: one Redis vs a Redis Cluster",
            "`bench.queue_throughput`'s work item with a run's queue in 1 or K partitions, two `rollq worker` "
            "processes, one producer + consumer; one redis-server against a local six-node Redis Cluster (three "
            "primaries, a replica each), all on the same machine, where the shards compete with the workers for the "
            "cores.",
            (
                Table(
                    "Throughput and CPU per trajectory",
                    "rows",
                    (
                        Col("trajectories/s", "traj_per_s", num()),
                        Col("vs one Redis, K = 1", "vs_redis_k1", times()),
                        Col("shards used", "shards_used", num()),
                        Col(
                            "CPU µs per trajectory: workers / producer+consumer / redis primaries",
                            "cpu_us_per_traj",
                            lambda c: (
                                f"{num()(c.get('workers'))} / {num()(c.get('bench_process'))} / {num()(c.get('redis'))}"
                            ),
                            left=True,
                        ),
                        Col("CPU s per primary", "redis_cpu_s_per_server", joined(num(2)), left=True),
                    ),
                    label="configuration",
                ),
            ),
        ),
        Bench(
            "redis_wait",
            "Redis WAIT on the trainer's writes",
            "A ledger write (ADMIT) and an ack of a trained group (COMMIT), each without and with "
            "`redis_wait_replicas: 1`, on a local six-node cluster; the variants take turns in rounds, each call timed "
            "alone.",
            (
                Table(
                    "Latency per write, ms",
                    (
                        ("ADMIT, plain", "rows/admit/plain"),
                        ("ADMIT, WAIT 1", "rows/admit/wait"),
                        ("COMMIT, plain", "rows/commit/plain"),
                        ("COMMIT, WAIT 1", "rows/commit/wait"),
                    ),
                    (
                        Col("p50", "p50_ms", num(3)),
                        Col("p90", "p90_ms", num(3)),
                        Col("p99", "p99_ms", num(3)),
                        Col("mean", "mean_ms", num(3)),
                        Col("p50 vs plain", "vs_plain_p50", times()),
                    ),
                    label="write",
                ),
            ),
            (Line(lambda s: f"WAITs that came back short: {num()(get(s, 'short'))} of {num()(get(s, 'waited'))}."),),
        ),
        Bench(
            "trainer",
            "Trainer at 1 and 2 ranks (FSDP2)",
            "The trainer's `Policy` under `torchrun` at 1 rank (one plain process) and at 2 ranks (the model sharded "
            "with FSDP2 over gloo, rank 0 driving, rank 1 following, as `rollq train` runs them), each the same fixed "
            "global batch: load, a few optimizer steps, `save_weights` (the safetensors the engines read, gathered to "
            "rank 0 bucket by bucket) and a distributed checkpoint saved and loaded. Memory per rank where each phase "
            "ends: the bytes of parameters, gradients and AdamW state in the rank's own shards, the resident memory "
            "(VmRSS) and its peak during the phase (VmHWM, reset as each phase starts). The shards halve; resident "
            "memory need not: every rank holds torch and transformers whole, at 1 rank the loaded weights stay file "
            "pages until the first step touches them, and glibc keeps freed buffers resident unless its mmap "
            "threshold is fixed (`--mmap-threshold`). The ranks share the machine's cores (one thread each at 2 "
            "ranks). `bench/trainer.py` describes the phases and each figure.",
            _trainer_tables(gpu=False),
            (Line(_trainer_line),),
        ),
        Bench(
            "lora",
            "LoRA: adapter updates and two runs on one engine",
            "One in-process reference engine (float32, CPU) per model. Publish: a full-weight update as the trainer "
            "sends one (safetensors written, pause -> /update_weights_from_disk -> resume) against an adapter of rank "
            "8 on every linear layer (PEFT files written as `Policy.save_adapter` writes them, /load_lora_adapter "
            "beside the previous version, which is then unloaded; no pause), seconds from the write to the engine "
            "serving it (median) and bytes written per update. Sharing: the tiny model's engine with two adapters "
            "loaded, concurrent generation loops on adapter A only, B only, then half on each: the tokens per second "
            "each run gets and the engine's total. `bench/lora.py` describes each figure.",
            (
                Table(
                    "Publish: full weights vs an adapter",
                    "publish",
                    (
                        Col("model", "model"),
                        Col("parameters", "params", num()),
                        Col("full update s", "full_s", num(3)),
                        Col("full MB", "full_bytes", lambda v: num(2)(v / 1e6) if v is not None else "-"),
                        Col("adapter s", "adapter_s", num(3)),
                        Col("adapter MB", "adapter_bytes", lambda v: num(3)(v / 1e6) if v is not None else "-"),
                        Col("adapter faster", "speedup", times(1)),
                        Col("fewer bytes", "bytes_ratio", times(1)),
                        Col("pauses per adapter update", "pauses_adapter", num()),
                    ),
                ),
                Table(
                    "Two runs on one engine, generated tokens/s",
                    (("", "sharing"),),
                    (
                        Col("A alone", "alone_a_tok_s", num()),
                        Col("B alone", "alone_b_tok_s", num()),
                        Col("shared: A", "shared_a_tok_s", num()),
                        Col("shared: B", "shared_b_tok_s", num()),
                        Col("shared: total", "shared_total_tok_s", num()),
                        Col("total vs one run alone", "shared_vs_alone", times()),
                        Col("each run keeps", "each_keeps", times()),
                    ),
                    label="clients",
                ),
            ),
            targets="",
        ),
        Bench(
            "lora_learn",
            "Two LoRA runs learning on one engine",
            "`python -m bench.lora --learn`: two `rollq train` runs of the toy task (LoRA rank 8, adapters published "
            "by version) at once on one reference engine registered in a fleet and one `rollq worker` serving both "
            "runs. Each run's last-10-step reward and the engine's count of control calls: adapter loads and "
            "unloads only, no pause and no full-weight update.",
            (
                Table(
                    "Runs",
                    "learn.runs",
                    (
                        Col("last-10 reward (target >= 0.95)", "reward_last10", num(4)),
                        Col("first-10 reward", "reward_first10", num(4)),
                        Col("steps", "steps", num()),
                    ),
                    label="run",
                ),
            ),
            (
                Line(
                    lambda s: (
                        f"Both runs together: {num()(get(s, 'learn.seconds'))} s. Engine control calls: "
                        f"{get(s, 'learn.control_calls')}."
                    )
                ),
            ),
            targets="",
            optional=True,
        ),
        Bench(
            "weight_sync",
            "Weight sync: deltas vs full updates",
            "A real training run of SmolLM2-135M-Instruct on its preset (the addition task, AdamW at lr 5e-6, 4 "
            "groups of 8 samples a step, generated by a reference engine with the weights it serves and scored by "
            "the task's reward). After each step the same new weights are published twice through the trainer's "
            "own publish path (`_publish_weights`, trainer/loop.py): as a delta (`delta_sync`, `delta_full_every` 0: "
            "XOR + zstd per tensor in the engines' dtype, each on the one before, rebuilt by the engine before the "
            "pause, its tensors made the parameters' storage under it) to one engine, and "
            "as a full update in bfloat16 every step (`delta_full_every` 1: written, then loaded under the pause) to "
            "another; the order alternates. Both engines are in-process reference engines serving bfloat16 on the "
            "CPU. Per update: the bytes the engine read, the seconds preparing (before the pause), the pause (from "
            "the pause call until the resume answered: the engine not generating), the whole publish (writing or "
            "encoding, preparing, the cycle) and the step (the train step plus that publish); medians over the "
            "steps, the delta side over its delta updates. After every step each engine's `/rollq/weights_checksum` "
            "is compared with the trainer's weights in bfloat16. Then the learning-rate sweep: a fresh policy from the "
            "same start at each lr, trained on the run's first batches, each step's weights encoded against the "
            "step before (no engines). On a GPU the pause has other costs (host-to-device copies, the cache flush): "
            "the ratios here are this CPU's. `bench/weight_sync.py` describes each figure.",
            (
                Table(
                    "Per update, median over the steps",
                    (
                        ("MB per update", "compare/bytes_mb"),
                        ("prepare s (before the pause)", "compare/prepare_s"),
                        ("pause s", "compare/pause_s"),
                        ("publish s", "compare/publish_s"),
                        ("step s (train + publish)", "compare/step_s"),
                    ),
                    (
                        Col("full (bfloat16)", "full", num(3)),
                        Col("delta", "delta", num(3)),
                        Col("delta / full", "ratio", times(3)),
                    ),
                ),
                Table(
                    "How the changed share moves with the learning rate",
                    "sweep",
                    (
                        Col("lr", "lr", _sci),
                        Col("steps", "steps", num()),
                        Col("weights changed (median)", "changed_share", pct(2)),
                        Col("delta bytes / full (median)", "delta_share", pct(2)),
                        Col("encode s", "encode_s", num(3)),
                    ),
                ),
                Table(
                    "Per step",
                    "per_step",
                    (
                        Col("step", "step", num()),
                        Col("reward", "reward", num(3)),
                        Col("train s", "train_s", num(2)),
                        Col("weights changed", "changed_share", pct(2)),
                        Col("delta MB", "delta/bytes", lambda v: num(2)(None if v is None else v / 1e6)),
                        Col("delta pause s", "delta/paused_s", num(3)),
                        Col("full MB", "full/bytes", lambda v: num(2)(None if v is None else v / 1e6)),
                        Col("full pause s", "full/paused_s", num(3)),
                    ),
                ),
            ),
            (Line(_weight_sync_line),),
        ),
        Bench(
            "gpu_check",
            "GPU readiness",
            "The trainer's policy (bfloat16 autocast, fused AdamW on CUDA) and the reference engine on one torch "
            "device, as `rollq up --device cuda` runs them: a few decoupled-PPO steps must move probability towards "
            "the better sample; the engine serves greedy tokens; the policy's weights load into the engine, whose "
            "logprobs then agree with the trainer's within the dtype's tolerance. Needs a CUDA GPU.",
            (
                Table(
                    "Checks",
                    (("policy", "policy"),),
                    (
                        Col("ok", "ok", yesno),
                        Col("fused AdamW", "fused_adamw", yesno),
                        Col("step s (first is warm-up)", "step_s", joined(num(4))),
                        Col("logprob gain better / worse", "logprob_gain_better_worse", joined(num(2), " / ")),
                    ),
                    label="part",
                ),
                Table(
                    "Pictures (the tiny Qwen2-VL)",
                    (("vision", "vision"),),
                    (
                        Col("ok", "ok", yesno),
                        Col("generate s", "generate_s", num(3)),
                        Col("image tokens", "image_tokens", num()),
                        Col("max logprob gap trainer vs engine", "max_logprob_gap_trainer_vs_engine", num(4)),
                        Col("tolerance", "tolerance", num(3)),
                    ),
                    label="part",
                ),
                Table(
                    "Engine",
                    (("engine", "engine"),),
                    (
                        Col("ok", "ok", yesno),
                        Col("generate s (first call)", "generate_s", num(3)),
                        Col("weight version served", "weight_version"),
                        Col("max logprob gap trainer vs engine", "max_logprob_gap_trainer_vs_engine", num(4)),
                        Col("tolerance", "tolerance", num(3)),
                    ),
                    label="part",
                ),
            ),
            (
                Line(
                    lambda s: (
                        f"Device {get(s, 'gpu') or get(s, 'device')}, {get(s, 'dtype')}; "
                        f"all checks passed: {yesno(get(s, 'ok'))}."
                    )
                ),
            ),
            missing="not run here: it needs a CUDA GPU (`python -m bench.gpu_check --device cpu` runs the same path on "
            "CPU, without a results file worth tabling)",
        ),
        Bench(
            "images",
            "Images: the stream, a worker, an engine",
            "A trajectory of the tiny Qwen2-VL on a 56x56 picture (the processor's pixel values, as AReaL's "
            "VisionRLVRWorkflow returns them) encoded as a worker publishes it with its picture inline or by "
            "reference (its digest; the pixels stored once in the blob store), beside the same sequence without one; a "
            "group's 8 job entries with the picture (PNG) inline in each or stored once by reference. A `rollq worker` "
            "process's CPU per sample running rollq's `vision_rlvr` on pictures vs `rlvr` on text prompts of the same "
            "token count against one scripted engine (read from /proc). The reference engine serving the tiny "
            "Qwen2-VL: 32 requests of 16 tokens at once, prompts with a picture vs text prompts of the same length.",
            (
                Table(
                    "Bytes",
                    (("", "stream_bytes"),),
                    (
                        Col("trajectory, text only", "trajectory_text_only", num()),
                        Col("trajectory, picture inline", "trajectory_inline", num()),
                        Col("trajectory, picture by reference", "trajectory_by_reference", num()),
                        Col("blob store per sample", "blob_store_bytes_per_sample", num()),
                        Col("a group's jobs, inline", "job_group_inline", num()),
                        Col("a group's jobs, by reference", "job_group_by_reference", num()),
                    ),
                ),
                Table(
                    "Worker CPU and engine throughput",
                    (("", ""),),
                    (
                        Col("worker CPU ms/sample, text", "worker_cpu/text_cpu_ms_per_sample", num(2)),
                        Col("worker CPU ms/sample, picture", "worker_cpu/image_cpu_ms_per_sample", num(2)),
                        Col("picture / text", "worker_cpu/image_over_text_cpu", times()),
                        Col("engine tokens/s, text", "engine/text_tokens_per_s", num()),
                        Col("engine tokens/s, picture", "engine/image_tokens_per_s", num()),
                        Col("picture / text", "engine/image_over_text", times()),
                    ),
                ),
            ),
            targets="",
        ),
        _tracing_bench(
            "tracing",
            "Rollout tracing: off, on, and no tracing code at all",
            "The same rollouts (a `rollq worker` running `rlvr` against a synthetic engine, 64 at a time, 8 tokens at "
            "0.1 s a step: generation bounds the throughput, as in RL) on a build from before tracing was added "
            "(none), this build with no endpoint (off), and every trace sampled and exported to a loopback OTLP "
            "receiver (on); interleaved, each round's ratio to its own `none`, the median over rounds.",
        ),
        _tracing_bench(
            "tracing-stress",
            "Rollout tracing under CPU-bound rollouts",
            "As above with generation nearly free (32 tokens at 2 ms a step): the worker, the engine, Redis and the "
            "benchmark share 2 cores flat out, so the CPU that tracing costs shows in the throughput.",
        ),
        _tracing_bench(
            "tracing-stress-sampled",
            "Rollout tracing under CPU-bound rollouts, one trace in ten",
            "The CPU-bound rollouts above with `trace_sample_rate` 0.1 when on (`--sample-rate 0.1`): a tenth of the "
            "jobs traced, decided at their submit, every later span following; what a run whose workers are bound "
            "by their CPU sets to keep tracing cheap.",
        ),
        Bench(
            "trainer_gpu",
            "Trainer on a GPU",
            "`bench.trainer --gpu`: the same phases on a CUDA device, `compute_dtype` bfloat16 (float32 master "
            "weights and AdamW state), one rank unless told more (N > 1 ranks take N GPUs and NCCL); beside the "
            "resident memory, the memory torch allocated on the device and its peak during each phase.",
            _trainer_tables(gpu=True),
            (Line(_trainer_line),),
            missing="not run here: it needs a CUDA GPU (`python -m bench.trainer --gpu`)",
        ),
    ]
}

HEADLINE: tuple[Headline, ...] = (
    Headline(
        "async_rl",
        "asynchronous (eta = 2) / synchronous RL, trained samples/s",
        lambda s: times()(get(s, "speedup")),
        ">= 2x (AReaL reports 2.77x at scale)",
    ),
    Headline(
        "async_rl",
        "tokens wasted by the staleness bound with the recommended trainer settings, at their speed-up",
        lambda s: f"{pct()(_async_recommended(s, 'waste'))} at {times()(_async_recommended(s, 'speedup'))}",
        "<= 5% at >= 3x",
    ),
    Headline(
        "queue_throughput",
        "1,024-token trajectories through Redis, one worker process",
        lambda s: f"{num()(get(s, 'rollq_traj_per_s'))}/s, {times(1)(get(s, 'rollq_vs_arq'))} arq",
        ">= 3,000/s, >= 10x arq",
    ),
    Headline(
        "agents",
        "agent episodes on a long-tailed workload, rollq / a batch loop with per-turn barriers",
        lambda s: times()(get(s, "long_tail/A_vs_B2")),
        ">= 1.5x",
    ),
    Headline(
        "agents",
        "recording proxy's own overhead per chat completion, p50",
        lambda s: signed(2, " ms")(get(s, "proxy_overhead/proxy_overhead_p50_ms")),
        "<= 1.5 ms",
    ),
    Headline(
        "ingress",
        "HTTP ingress, jobs accepted",
        lambda s: f"{num()(get(s, 'accept/jobs_per_s'))}/s",
        ">= 5,000/s",
    ),
    Headline(
        "trainer",
        "trainer memory per rank (parameters, gradients, AdamW state), 2 FSDP ranks / 1",
        lambda s: f"{times(3)(get(s, 'bytes_ratio'))} ({get(s, 'model')})",
        "<= 0.55x",
    ),
    Headline(
        "lora",
        "a LoRA adapter update vs a full-weight update, publish to serving, 135M model (no pause)",
        lambda s: (
            f"{times(1)(_lora_row(s).get('speedup'))} faster, {times(0)(_lora_row(s).get('bytes_ratio'))} fewer bytes"
        ),
        "faster, no pause",
    ),
    Headline(
        "weight_sync",
        "a delta weight update vs a full bfloat16 update, SmolLM2-135M at the preset's lr: bytes, pause, bit-exact",
        lambda s: (
            f"{pct(1)(get(s, 'compare/bytes_mb/ratio'))} of the bytes, {times(2)(get(s, 'compare/pause_s/ratio'))} "
            f"the pause, bit-exact: {yesno(get(s, 'bit_exact'))}"
        ),
        "<= 5%, <= 0.5x, bit-exact",
    ),
)


def _lora_row(s: Any) -> dict[str, Any]:
    rows = [r for r in get(s, "publish") or [] if r.get("model") == "smollm2-135m-shape"]
    return rows[0] if rows else {}


# -- rendering -----------------------------------------------------------------------------------------------------


def _short_commit(rec: Record) -> str:
    c = rec.get("commit")
    if not c:
        return "commit unknown"
    dirty = rec.get("dirty")
    return f"commit `{c[:10]}`" + (
        " with uncommitted changes" if dirty else "" if dirty is False else " (tree state unknown)"
    )


def _machine(rec: Record, full: bool = False) -> str:
    m = rec.get("machine") or {}
    gpus = m.get("gpus") or []
    parts = [
        f"{m.get('cpus', '?')} x {m.get('cpu', '?')}",
        f"{m.get('memory_gib', '?')} GiB",
        ", ".join(gpus) or "no GPU",
    ]
    if full:
        parts += [f"Python {m.get('python', '?')}", f"torch {m.get('torch') or 'absent'}", str(m.get("os", "?"))]
    return ", ".join(parts)


def _date(rec: Record) -> str:
    d = str(rec.get("date", "?"))  # 2026-11-26T19:12:19Z
    return d[:16].replace("T", " ") + " UTC" if len(d) >= 16 else d


def _load(rec: Record, which: str) -> str:
    v = (rec.get("load_avg") or {}).get(which) or []
    return " / ".join(f"{x:.2f}" for x in v) if v else "?"


def provenance(rec: Record) -> str:
    """The line under each of a bench's tables: command, date, commit, machine and its load when the run started
    (the Runs table adds Python, torch, the OS, the load at the end and the run time)."""
    return (
        f"*Measured by `{rec.get('command', '?')}`, {_date(rec)}, {_short_commit(rec)}; {_machine(rec)}; load "
        f"average {_load(rec, 'start')} (1 / 5 / 15 min) at the start.*"
    )


def _rows(table: Table, summary: Any) -> tuple[list[tuple[str | None, Any]], bool]:
    """(label or None, row) pairs, and whether there is a label column."""
    root = get(summary, table.root)
    if isinstance(table.rows, tuple):
        return [(label, get(root, path)) for label, path in table.rows], True
    data = table.rows(root) if callable(table.rows) else get(root, table.rows)
    if isinstance(data, Mapping):
        if table.labels:  # these rows only, in this order
            return [(label, data[k]) for k, label in table.labels.items() if k in data], True
        return list(data.items()), True
    if isinstance(data, list):
        return [(None, v) for v in data], False
    return [], False


def render_table(table: Table, summary: Any) -> str:
    rows, labelled = _rows(table, summary)
    rows = [(label, row) for label, row in rows if row is not None]
    if not rows:
        return f"**{table.caption}**: not in this run.\n"
    heads = ([table.label or " "] if labelled else []) + [c.head for c in table.cols]
    aligns = (["---"] if labelled else []) + ["---" if c.left else "---:" for c in table.cols]
    lines = [f"**{table.caption}**", "", "| " + " | ".join(map(cell, heads)) + " |", "|" + "|".join(aligns) + "|"]
    for label, row in rows:
        cells = ([str(label)] if labelled else []) + [c.fmt(get(row, c.path)) for c in table.cols]
        lines.append("| " + " | ".join(map(cell, cells)) + " |")
    return "\n".join(lines) + "\n"


def _targets(bench: Bench, summary: Any) -> str:
    t = get(summary, bench.targets) if bench.targets else None
    if not isinstance(t, Mapping) or not t:
        return ""
    items = [f"`{k}` {met(v)}" for k, v in t.items() if isinstance(v, bool) or v is None]
    return "Targets: " + ", ".join(items) + "." if items else ""


def anchor(title: str) -> str:
    """The heading's id as MkDocs' toc extension makes it."""
    keep = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return "-".join(keep.split())


def render_bench(bench: Bench, rec: Record | None) -> str:
    out = [f"## {bench.title}", "", bench.about, ""]
    if rec is None:
        out += [f"*{bench.missing}*", ""]
        return "\n".join(out)
    summary = rec.get("summary")
    prov = provenance(rec)
    for table in bench.tables:
        out += [render_table(table, summary), prov, ""]
    for line in bench.lines:
        s = line.render(summary)
        if s:
            out += [s, ""]
    t = _targets(bench, summary)
    if t:
        out += [t, ""]
    if not bench.tables:
        out += [prov, ""]
    return "\n".join(out)


def load_results(folder: Path) -> dict[str, Record]:
    """Every results file in `folder`, by bench name; a file no spec renders is an error (add a spec)."""
    out: dict[str, Record] = {}
    for path in sorted(folder.glob("*.json")):
        rec = json.loads(path.read_text())
        if path.stem not in BENCHES:
            raise SystemExit(f"{path}: no table spec for bench {path.stem!r} in bench/report.py")
        out[path.stem] = rec
    return out


def render_headline(results: Mapping[str, Record], link: str = "docs/benchmarks.md") -> str:
    """The README's block: the figures that matter most, each linked to its section of the page."""
    lines = ["| measured | result | target |", "|---|---|---|"]
    for h in HEADLINE:
        rec = results.get(h.bench)
        value = h.value(rec["summary"]) if rec else "not run"
        lines.append(
            f"| [{cell(h.what)}]({link}#{anchor(BENCHES[h.bench].title)}) | {cell(value)} | {cell(h.target)} |"
        )
    used = [results[b] for b in dict.fromkeys(h.bench for h in HEADLINE) if b in results]
    machines = sorted({_machine(rec) for rec in used})
    dates = sorted({_date(rec)[:10] for rec in used})
    when = "" if not dates else f", {dates[0]}" + ("" if dates[-1] == dates[0] else f" to {dates[-1]}")
    lines += [
        "",
        f"Measured on {' and on '.join(machines) or 'nothing yet'}{when}; rendered by `python -m bench.report` from "
        "`bench/results/`.",
    ]
    return "\n".join(lines)


def render_page(results: Mapping[str, Record]) -> str:
    out = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python -m bench.report` from bench/results/*.json: edit bench/report.py, not this. -->",
        "",
        "After this page you know what each benchmark measures, what it measured last (the command, date, commit and "
        "machine are under every table), and how to measure it again.",
        "",
        "Every benchmark runs from the repository root as `python -m bench.NAME` (`--quick` for a smoke run where it "
        "has one), prints a JSON summary as its last line and writes it with its provenance to "
        "`bench/results/NAME.json` (`--results DIR` elsewhere, `--results ''` nowhere). `python -m bench.report` "
        "renders this page and the README's headline from those files; a test fails when either differs from what "
        "the committed files render. Most benchmarks compare against a baseline measured in the same run: on a "
        "shared machine ratios hold better than absolute rates, and the load average is recorded to show how busy "
        "the machine was.",
        "",
        "## Headline",
        "",
        render_headline(results, link="benchmarks.md").replace("](benchmarks.md#", "](#"),
        "",
        "## Runs",
        "",
        "| bench | command | date | commit | run time | load average at the start / end | machine |",
        "|---|---|---|---|---:|---|---|",
    ]
    for b in BENCHES.values():
        rec = results.get(b.name)
        if rec is None:
            if not b.optional:
                out.append(f"| [{b.name}](#{anchor(b.title)}) | {cell(b.missing)} |" + f" {DASH} |" * 5)
            continue
        took = rec.get("duration_s")
        out.append(
            f"| [{b.name}](#{anchor(b.title)}) | `{cell(rec.get('command', '?'))}` | {_date(rec)} | "
            f"{cell(_short_commit(rec))} | {DASH if took is None else f'{took:,.0f} s'} | "
            f"{_load(rec, 'start')}; {_load(rec, 'end')} | {cell(_machine(rec, full=True))} |"
        )
    out.append("")
    for b in BENCHES.values():
        rec = results.get(b.name)
        if rec is None and b.optional:
            continue
        out.append(render_bench(b, rec))
    return "\n".join(out).rstrip("\n") + "\n"


def splice(readme: str, block: str) -> str | None:
    """The README with `block` between the markers, or None where they are missing."""
    i, j = readme.find(START), readme.find(END)
    if i < 0 or j < i:
        return None
    return readme[: i + len(START)] + "\n" + block + "\n" + readme[j:]


def check(results_dir: Path = RESULTS_DIR, page: Path = PAGE, readme: Path = README) -> list[str]:
    """What differs between the committed page / README block and what the results files render."""
    results = load_results(results_dir)
    problems = []
    want = render_page(results)
    have = page.read_text() if page.exists() else ""
    if have != want:
        diff = difflib.unified_diff(have.splitlines(), want.splitlines(), str(page), "rendered", lineterm="", n=1)
        problems.append(f"{page} differs from what `python -m bench.report` renders:\n" + "\n".join(list(diff)[:40]))
    text_ = readme.read_text()
    spliced = splice(text_, render_headline(results))
    if spliced is None:
        problems.append(f"{readme}: no {START} ... {END} markers for the benchmark headline")
    elif spliced != text_:
        diff = difflib.unified_diff(text_.splitlines(), spliced.splitlines(), str(readme), "rendered", lineterm="", n=1)
        problems.append(f"{readme}'s headline differs from what `python -m bench.report` renders:\n" + "\n".join(diff))
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the page or the README block would change")
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help="the results folder (default bench/results)")
    p.add_argument("--page", type=Path, default=PAGE, help="the page (default docs/benchmarks.md)")
    p.add_argument("--readme", type=Path, default=README, help="the README holding the headline markers")
    args = p.parse_args(argv)
    if args.check:
        problems = check(args.results, args.page, args.readme)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("run `python -m bench.report` and commit the result", file=sys.stderr)
        return 1 if problems else 0
    results = load_results(args.results)
    args.page.write_text(render_page(results))
    readme = args.readme.read_text()
    spliced = splice(readme, render_headline(results))
    if spliced is None:
        print(f"{args.readme}: no {START} ... {END} markers; the headline was not written", file=sys.stderr)
        return 1
    if spliced != readme:
        args.readme.write_text(spliced)
    return 0


if __name__ == "__main__":
    sys.exit(main())
