"""GPU readiness, standalone (no Redis, no workers, no network): the trainer's policy and the reference engine on one
torch device, the way `rollq up --device cuda` runs them.

    python -m bench.gpu_check                 # --device cuda, bfloat16 (or: python bench/gpu_check.py)
    python -m bench.gpu_check --device cpu    # the same path on CPU (what CI can check)

1. The trainer's `Policy` with `compute_dtype` bfloat16 (autocast; float32 master weights) and, on CUDA, fused
   AdamW: a few decoupled-PPO steps on a two-sample group must move probability towards the better sample, with a
   finite loss and gradient; step times are reported.
2. The reference engine (`ReferenceBackend`, `dtype` bfloat16 on the device) serves /generate: greedy tokens with
   logprobs.
3. The policy's weights, written as the trainer writes them, load into the engine (`/update_weights_from_disk`,
   weight version 1), and the engine's logprobs of its greedy answer then agree with the trainer's own within the
   tolerance of the compute dtype.
4. Pictures: the tiny Qwen2-VL in the engine and the trainer on the device; the trainer's logprobs of the engine's
   answer to a picture, with the same picture, agree with the engine's; a training step on it is finite.
Meant for a lent GPU machine, which may have another Python / torch and no Redis: it needs only this repository's
packages. The last line printed is a JSON summary (`ok`: every check passed).
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/gpu_check.py`: the repository root on sys.path)

import argparse
import asyncio
import json
import math
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from bench.results import add_results_arg, write_results


def policy_checks(device: str, dtype: str, steps: int) -> tuple[Any, dict[str, Any]]:
    import torch

    from rollq.protocol.arrays import Float32Array, Int32Array, UInt8Array
    from rollq.protocol.messages import Sequence, Trajectory
    from rollq.trainer.batch import Group, build_batch
    from rollq.trainer.config import TrainConfig
    from rollq.trainer.policy import Policy

    policy = Policy(TrainConfig(lr=1e-2, device=device, compute_dtype=dtype))  # type: ignore[arg-type]
    prompt = policy.tokenizer.encode("Write a number using digits only.")
    good, bad = prompt + [20, 21, 22], prompt + [300, 301, 302]
    mask = [0] * len(prompt) + [1, 1, 1]
    with torch.no_grad():
        ones = torch.ones(1, len(good), dtype=torch.long, device=device)
        behav = [policy.token_logprobs(torch.tensor([s], device=device), ones)[0].tolist() for s in (good, bad)]
    samples = [
        Trajectory(
            job_id="g",
            sample_index=i,
            n=2,
            status="ok",
            sequences=[
                Sequence(
                    input_ids=Int32Array(ids),
                    loss_mask=UInt8Array(mask),
                    logprobs=Float32Array([0.0, *lp]),
                    versions=Int32Array([0] * len(ids)),
                    reward=r,
                )
            ],
        )
        for i, (ids, lp, r) in enumerate(((good, behav[0], 1.0), (bad, behav[1], 0.0)))
    ]
    batch = build_batch([Group(job_id="g", samples=samples)], policy.pad_id)
    ids, attn = batch.input_ids.to(device), batch.attention_mask.to(device)
    before = policy.token_logprobs(ids, attn).detach().cpu()
    times, stats = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        stats.append(policy.train_step(batch))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    after = policy.token_logprobs(ids, attn).detach().cpu()
    gain = ((after - before) * batch.loss_mask).sum(dim=1)
    fused = bool(policy.optimizer.defaults.get("fused"))
    ok = bool(gain[0] > 0 > gain[1]) and all(math.isfinite(s.loss) and math.isfinite(s.grad_norm) for s in stats)
    return policy, {
        "ok": ok,
        "fused_adamw": fused,
        "step_s": [round(t, 4) for t in times],
        "logprob_gain_better_worse": [round(float(g), 4) for g in gain],
        "weights_dtype": str(next(policy.model.parameters()).dtype),
    }


async def engine_checks(policy: Any, device: str, dtype: str, tmp: Path) -> dict[str, Any]:
    import httpx
    import torch

    from rollq.engine.server.app import EngineServerConfig, serve
    from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig

    engine = await serve(
        ReferenceBackend(ReferenceConfig(model="tiny", device=device, dtype=dtype, max_running=8)),
        EngineServerConfig(port=0, weights_root=str(tmp)),
    )
    try:
        prompt = policy.tokenizer.encode("Write a number using digits only.")
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
            "return_logprob": True,
        }
        async with httpx.AsyncClient(timeout=60) as http:
            t0 = time.perf_counter()
            first = (await http.post(f"{engine.url}/generate", json=body)).json()
            gen_s = time.perf_counter() - t0
            weights = policy.save_weights(tmp / "v1")
            update = {"model_path": str(weights), "weight_version": "1"}
            loaded = (await http.post(f"{engine.url}/update_weights_from_disk", json=update)).json()
            second = (await http.post(f"{engine.url}/generate", json=body)).json()
        out_ids = second["output_ids"]
        served = [lp[0] for lp in second["meta_info"]["output_token_logprobs"]]
        seq = torch.tensor([prompt + out_ids], device=device)
        with torch.no_grad():
            own = policy.token_logprobs(seq, torch.ones_like(seq))[0, len(prompt) - 1 :].cpu().tolist()
        gap = max((abs(a - b) for a, b in zip(own, served, strict=True)), default=0.0)
        tolerance = 1e-3 if dtype == "float32" else 0.15
        return {
            "ok": bool(first["output_ids"]) and bool(loaded.get("success")) and gap <= tolerance,
            "generate_s": round(gen_s, 4),
            "tokens": len(out_ids),
            "weight_version": second["meta_info"].get("weight_version"),
            "max_logprob_gap_trainer_vs_engine": round(gap, 5),
            "tolerance": tolerance,
        }
    finally:
        await engine.close()


async def vision_checks(device: str, dtype: str) -> dict[str, Any]:
    """The tiny Qwen2-VL on the device: the reference engine answers a picture (its vision tower and 3-D rope in
    the compute dtype), and the trainer's logprobs of that answer with the same picture agree with the engine's; a
    training step on it is finite."""
    import torch
    from PIL import Image

    from rollq.engine.models import model_dir
    from rollq.engine.server.backend import GenState
    from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig
    from rollq.engine.tiny_vlm import load_processor
    from rollq.engine.types import SamplingParams
    from rollq.protocol.media import pil_to_image_file
    from rollq.protocol.messages import Trajectory
    from rollq.trainer.batch import Group, build_batch
    from rollq.trainer.config import TrainConfig
    from rollq.trainer.policy import Policy
    from rollq.workers.outputs import to_sequences

    processor = load_processor(model_dir("tiny-vl"))
    content = [{"type": "image"}, {"type": "text", "text": "Which colour?"}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    picture = Image.new("RGB", (56, 56), (200, 30, 30))
    inputs = processor(images=[picture], text=text, return_tensors="pt")
    prompt = inputs["input_ids"][0].tolist()
    backend = ReferenceBackend(ReferenceConfig(model="tiny-vl", device=device, dtype=dtype, max_running=2))
    await backend.start()
    try:
        file = pil_to_image_file(picture)
        state = GenState("v", prompt, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True), True)
        state.input_ids, state.vision = await asyncio.to_thread(backend.prepare_images, prompt, [file])
        state.images = [file]
        t0 = time.perf_counter()
        await backend.run(state)
        gen_s = time.perf_counter() - t0
    finally:
        await backend.close()
    out = state.output_ids
    episode = {
        "input_ids": prompt + out,
        "loss_mask": [0] * len(prompt) + [1] * len(out),
        "logprobs": [0.0] * len(prompt) + list(state.output_logprobs),
        "versions": [-1] * len(prompt) + [0] * len(out),
        "reward": 1.0,
        "multi_modal_input": [{"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}],
        "mm_token_type_ids": inputs["mm_token_type_ids"][0].tolist() + [0] * len(out),
    }
    [seq] = to_sequences(episode)
    policy = Policy(TrainConfig(model="tiny-vl", device=device, compute_dtype=dtype))  # type: ignore[arg-type]
    samples = [Trajectory(job_id="g", sample_index=0, n=2, status="ok", sequences=[seq])]
    other = msgspec.structs.replace(seq, reward=0.0)
    samples.append(Trajectory(job_id="g", sample_index=1, n=2, status="ok", sequences=[other]))
    batch = build_batch([Group(job_id="g", samples=samples)], policy.pad_id)
    rows = policy._rows(batch)
    with torch.no_grad():
        own = policy._logprobs_of(rows, [0], batch.input_ids.shape[1])[0, len(prompt) - 1 :].cpu().tolist()
    gap = max((abs(a - b) for a, b in zip(own, state.output_logprobs, strict=True)), default=0.0)
    stats = policy.train_step(batch)
    tolerance = 1e-3 if dtype == "float32" else 0.15
    return {
        "ok": len(out) == 8 and gap <= tolerance and math.isfinite(stats.loss) and math.isfinite(stats.grad_norm),
        "generate_s": round(gen_s, 4),
        "image_tokens": int(inputs["mm_token_type_ids"].sum()),
        "max_logprob_gap_trainer_vs_engine": round(gap, 5),
        "tolerance": tolerance,
        "train_loss_finite": math.isfinite(stats.loss),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="torch device (default cuda)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype")
    p.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    add_results_arg(p)
    args = p.parse_args(argv)

    import torch

    summary: dict[str, Any] = {
        "device": args.device,
        "dtype": args.dtype,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            summary["ok"] = False
            summary["error"] = "no CUDA device"
            print(json.dumps(summary))
            write_results("gpu_check", summary, args.results, argv)
            return 1
        summary["gpu"] = torch.cuda.get_device_name(0)
    policy, summary["policy"] = policy_checks(args.device, args.dtype, args.steps)
    with tempfile.TemporaryDirectory(prefix="rollq-gpu-check-") as tmp:
        summary["engine"] = asyncio.run(engine_checks(policy, args.device, args.dtype, Path(tmp)))
    summary["vision"] = asyncio.run(vision_checks(args.device, args.dtype))
    summary["ok"] = summary["policy"]["ok"] and summary["engine"]["ok"] and summary["vision"]["ok"]
    print(json.dumps(summary), flush=True)
    write_results("gpu_check", summary, args.results, argv)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
