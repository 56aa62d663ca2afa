"""LoRA: publishing an adapter vs a full-weight update, and two runs sharing one engine (JSON summary last).

1. publish: for the tiny model and a random-init model of SmolLM2-135M's shape, on one in-process reference engine
   (float32, CPU): a full-weight update as a trainer publishes one (safetensors written, pause -> load -> resume)
   vs an adapter of rank 8 on every linear layer (PEFT files written, /load_lora_adapter beside the previous
   version, no pause). Seconds from the trainer's write to the engine serving it (median of `repeat`) and bytes
   written per update.
2. sharing: the tiny model's engine with two adapters loaded; `clients` concurrent generation loops for `seconds`
   each way: all requests on adapter A (run A alone), all on B (run B alone), half on each (both runs on one
   engine). Tokens per second per run and in all: what a run keeps of the engine when another shares it, and what
   the mixed-adapter batches cost the engine.
3. --learn: two LoRA runs (the toy task, rank 8) training at once on one reference engine and one worker process
   serving both (a fleet): each run's last-10-step reward, its seconds, and the engine's control calls (only
   adapter loads and unloads: no run paused the other). The learning loop of CONTRIBUTING.md.

  python -m bench.lora [--repeat N] [--seconds S] [--clients C] [--learn] [--steps N]
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/lora.py`: the repository root on sys.path)

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import print_summary
from bench.results import add_results_arg, write_results

RANK = 8


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.suffix == ".safetensors")


def adapter_model(model_dir: Path, seed: int) -> Any:
    """The model with an adapter (random A and B, as a trained one): what a LoRA trainer holds."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(base, config)


def write_adapter(model: Any, directory: Path, step: int) -> int:
    """A step's adapter written as the trainer writes it (Policy.save_adapter: PEFT's format); its bytes on disk."""
    import torch

    from rollq.trainer.lora import write_adapter as write

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(1e-3 * step)
    write(directory, model)
    return _size(directory)


async def publish(model_dir: Path, repeat: int, work: Path) -> dict[str, Any]:
    from bench.engine_weights import perturbed, save
    from rollq.engine.fleet import FleetController
    from rollq.engine.pool import EnginePool, PoolConfig
    from rollq.engine.server.app import EngineServerConfig, serve
    from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig

    backend = ReferenceBackend(ReferenceConfig(model=str(model_dir), max_running=4))
    handle = await serve(backend, EngineServerConfig(port=0, weights_root=str(work), enable_lora=True))
    pool = EnginePool(PoolConfig(urls=[handle.url]))
    fleet = FleetController(pool)
    try:
        full_s, full_bytes, adapter_s, adapter_bytes = [], 0, [], 0
        model = backend.base
        params = sum(p.numel() for p in model.parameters())
        for i in range(repeat):
            t0 = time.monotonic()
            full_bytes = await asyncio.to_thread(save, perturbed(model, i + 1), work / f"v{i}")
            report = await fleet.run_cycle(lambda i=i: fleet.update_weights(str(work / f"v{i}"), i + 1))
            assert not report.update.failed, report.update.failed
            full_s.append(time.monotonic() - t0)
            shutil.rmtree(work / f"v{i}", ignore_errors=True)
        trainer = await asyncio.to_thread(adapter_model, model_dir, 0)
        for i in range(repeat + 1):  # the first load also wraps the model (peft): not measured
            t0 = time.monotonic()
            adapter_bytes = await asyncio.to_thread(write_adapter, trainer, work / f"adapter-v{i}", i)
            report = await fleet.load_adapter(f"run-v{i}", str(work / f"adapter-v{i}"))
            assert not report.update.failed, report.update.failed
            if i:
                adapter_s.append(time.monotonic() - t0)
                await fleet.unload_adapter(f"run-v{i - 1}")
        return {
            "params": params,
            "full_s": statistics.median(full_s),
            "full_bytes": full_bytes,
            "adapter_s": statistics.median(adapter_s),
            "adapter_bytes": adapter_bytes,
            "pauses_full": 1,
            "pauses_adapter": handle.server.control_calls["/pause_generation"] - repeat,  # the full updates' only
            "speedup": statistics.median(full_s) / statistics.median(adapter_s),
            "bytes_ratio": full_bytes / adapter_bytes,
        }
    finally:
        await pool.close()
        await handle.close()


async def sharing(seconds: float, clients: int, work: Path, tiny: Path) -> dict[str, Any]:
    import httpx

    from rollq.engine.server.app import EngineServerConfig, serve
    from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig

    backend = ReferenceBackend(ReferenceConfig(model=str(tiny), max_running=64))
    handle = await serve(backend, EngineServerConfig(port=0, weights_root=str(work), enable_lora=True))
    try:
        async with httpx.AsyncClient(timeout=120) as http:
            for name in ("A", "B"):
                path = work / f"share-{name}"
                await asyncio.to_thread(write_adapter, await asyncio.to_thread(adapter_model, tiny, ord(name)), path, 1)
                r = await http.post(handle.url + "/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
                assert r.status_code == 200, r.text

            async def loop(adapter: str, until: float, counts: dict[str, int], seed: int) -> None:
                prompt = [5 + seed % 50, 6, 7, 8, 9, 10, 11, 12]
                while time.monotonic() < until:
                    body = {
                        "input_ids": prompt,
                        "sampling_params": {"max_new_tokens": 32, "temperature": 1.0, "ignore_eos": True},
                        "lora_path": adapter,
                    }
                    r = await http.post(handle.url + "/generate", json=body)
                    counts[adapter] += len(r.json()["output_ids"])

            async def phase(adapters: list[str]) -> dict[str, float]:
                counts = dict.fromkeys(("A", "B"), 0)
                until = time.monotonic() + seconds
                await asyncio.gather(*(loop(adapters[i % len(adapters)], until, counts, i) for i in range(clients)))
                return {k: v / seconds for k, v in counts.items()}

            await phase(["A", "B"])  # warm-up (first batches, allocations)
            alone_a, alone_b, shared = await phase(["A"]), await phase(["B"]), await phase(["A", "B"])
        alone = (alone_a["A"] + alone_b["B"]) / 2
        return {
            "clients": clients,
            "seconds": seconds,
            "alone_a_tok_s": alone_a["A"],
            "alone_b_tok_s": alone_b["B"],
            "shared_a_tok_s": shared["A"],
            "shared_b_tok_s": shared["B"],
            "shared_total_tok_s": shared["A"] + shared["B"],
            "shared_vs_alone": (shared["A"] + shared["B"]) / alone,  # the engine's throughput, mixed vs one adapter
            "each_keeps": min(shared["A"], shared["B"]) / alone,  # a run's part of the engine when shared
        }
    finally:
        await handle.close()


async def learn(steps: int, work: Path) -> dict[str, Any]:
    """Two `rollq train` runs, one engine, one worker serving both (a fleet), Redis private to the benchmark."""
    import httpx

    from bench.common import bench_env, rollq_argv, start_redis
    from rollq.local import Processes, free_port, wait_until
    from rollq.up import engine_healthy

    for folder in ("logs", "redis", "weights"):
        (work / folder).mkdir(parents=True, exist_ok=True)
    procs = Processes(work / "logs")
    runs = ["lora-a", "lora-b"]
    try:
        url = start_redis(procs, work / "redis")
        port = free_port()
        engine = f"http://127.0.0.1:{port}"
        env = {**bench_env(), "ROLLQ_ENGINE_WEIGHTS_ROOT": str(work / "weights")}
        argv = [*rollq_argv(), "engine", "--backend", "reference", "--model", "tiny", "--port", str(port)]
        argv.append("--insecure-no-auth")  # keyless on loopback: the bench loads adapters through control routes
        argv += ["--weight-version", "0", "--enable-lora", "--register", "--redis", url, "--fleet", "bench"]
        procs.start("engine", argv, env=env)
        await procs.wait_until(lambda: engine_healthy(engine), 300, "the engine", interval_s=0.1)
        worker = [*rollq_argv(), "worker", "--redis", url, "--run", runs[0], "--also-serve", runs[1]]
        worker += ["--fleet", "bench", "--concurrency", "64", "--tokenizer", "tiny"]
        procs.start("worker", worker, env=bench_env())
        t0 = time.monotonic()
        trainers = {}
        for run in runs:
            argv = [*rollq_argv(), "train", "--redis", url, "--run", run, "--fleet", "bench", "--lora-rank", str(RANK)]
            argv += ["--steps", str(steps), "--run-dir", str(work / run), "--weights-dir", str(work / "weights" / run)]
            trainers[run] = procs.start(f"train-{run}", argv, env=bench_env())
        # (the trainers end by themselves: their exits are theirs to report, not a child failure of the harness)
        await wait_until(lambda: all(p.poll() is not None for p in trainers.values()), 3600, 1.0, "both runs")
        for proc in trainers.values():
            procs.reap(proc)
        seconds = time.monotonic() - t0
        out: dict[str, Any] = {"steps": steps, "seconds": seconds, "runs": {}}
        for run, proc in trainers.items():
            lines = (work / "logs" / f"train-{run}.log").read_text().strip().splitlines()
            summary = json.loads(lines[-1]) if proc.returncode == 0 else {"error": lines[-5:]}
            out["runs"][run] = summary
        async with httpx.AsyncClient(timeout=30) as http:
            metrics = (await http.get(engine + "/metrics")).text
        calls = {}
        for line in metrics.splitlines():
            if line.startswith("rollq:control_calls_total"):
                route = line.split('route="', 1)[1].split('"', 1)[0]
                calls[route] = float(line.rsplit(" ", 1)[1])
        out["control_calls"] = calls
        out["both_learnt"] = all(r.get("reward_last10", 0) >= 0.95 for r in out["runs"].values())
        out["no_pause"] = not any(calls.get(r) for r in ("/pause_generation", "/update_weights_from_disk"))
        return out
    finally:
        procs.stop_all()


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    from bench.engine_weights import smollm2_shaped
    from rollq.engine.tiny_model import build_tiny

    out: dict[str, Any] = {"repeat": args.repeat, "publish": []}
    with tempfile.TemporaryDirectory(prefix="rollq-bench-lora-") as tmp:
        root = Path(tmp)
        tiny = build_tiny(root / "cache" / "tiny-model")
        if args.learn:
            out["learn"] = await learn(args.steps, root / "learn")
            return out
        models = {"tiny": tiny, "smollm2-135m-shape": smollm2_shaped(root / "smollm2", tiny)}
        for name, directory in models.items():
            (root / name / "work").mkdir(parents=True, exist_ok=True)
            row = await publish(directory, args.repeat, root / name / "work")
            out["publish"].append({"model": name, **row})
        (root / "share").mkdir()
        out["sharing"] = await sharing(args.seconds, args.clients, root / "share", tiny)
    return out


def table(out: dict[str, Any]) -> str:
    if "learn" in out:
        learnt = out["learn"]
        lines = [f"{'run':<10}{'last-10':>9}"]
        for run, s in learnt["runs"].items():
            lines.append(f"{run:<10}{s.get('reward_last10', float('nan')):>9.4f}")
        lines.append(f"both runs: {learnt['seconds']:.0f} s; engine control calls: {learnt['control_calls']}")
        return "\n".join(lines)
    head = f"{'model':<20}{'full s':>9}{'full MB':>9}{'adapter s':>11}{'adapter MB':>12}{'x faster':>10}{'x bytes':>9}"
    lines = [head, "-" * len(head)]
    for r in out["publish"]:
        lines.append(
            f"{r['model']:<20}{r['full_s']:>9.3f}{r['full_bytes'] / 1e6:>9.2f}{r['adapter_s']:>11.3f}"
            f"{r['adapter_bytes'] / 1e6:>12.3f}{r['speedup']:>10.1f}{r['bytes_ratio']:>9.1f}"
        )
    s = out["sharing"]
    lines.append("")
    total, a, b = s["shared_total_tok_s"], s["shared_a_tok_s"], s["shared_b_tok_s"]
    lines.append(f"tok/s  A alone {s['alone_a_tok_s']:.0f}  B alone {s['alone_b_tok_s']:.0f}")
    lines.append(f"tok/s  shared: A {a:.0f} + B {b:.0f} = {total:.0f} ({s['shared_vs_alone']:.2f}x of one run alone)")
    lines.append(f"each run keeps {s['each_keeps']:.2f} of the engine")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="updates measured per kind (median)")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each sharing phase")
    p.add_argument("--clients", type=int, default=32, help="concurrent generation loops in the sharing phases")
    p.add_argument("--learn", action="store_true", help="two LoRA runs learning on one engine instead")
    p.add_argument("--steps", type=int, default=200, help="with --learn: steps of each run")
    add_results_arg(p)
    args = p.parse_args()
    out = asyncio.run(run_all(args))
    print()
    print(table(out))
    print_summary(out)
    write_results("lora_learn" if args.learn else "lora", out, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
