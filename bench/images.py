"""Images: what they cost the stream, a worker and an engine (JSON summary last).

1. stream bytes: a trajectory of the tiny Qwen2-VL on a picture of `size` pixels (the processor's pixel values, as
   AReaL's VisionRLVRWorkflow returns them), encoded as a worker publishes it with its images inline vs by reference
   (the digest; the pixels stored once in the blob store), beside the same sequence without images; and a job's data
   with the picture (PNG) inline in every one of a group's n entries vs stored once by reference.
2. worker CPU: a `rollq worker` process running `jobs` episodes of rollq's `vision_rlvr` workflow on pictures vs
   `rlvr` on text prompts of the same token count, against one scripted engine (a real server; the engine's time
   is not the worker's): the worker's CPU seconds per sample, read from /proc after each batch.
3. engine throughput: the reference engine serving the tiny Qwen2-VL, `requests` requests of `new` tokens each, all
   at once: prompts with a picture vs text prompts of the same token count (greedy, ignore_eos): tokens per second.

  python -m bench.images [--size PX] [--jobs N] [--requests N] [--new N]
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/images.py`: the repository root on sys.path)

import argparse
import asyncio
import random
import time
from pathlib import Path
from typing import Any

import msgspec

from bench.common import BenchError, print_summary, proc_cpu_s, run_bench, start_redis, start_worker
from bench.results import add_results_arg, write_results
from rollq.local import Processes

GROUP_N = 8  # samples per prompt: a job's data is in each of its n entries unless stored by reference


def _processor_and_picture(size: int) -> tuple[Any, Any, str]:
    from rollq.engine.models import model_dir
    from rollq.engine.tiny_vlm import load_processor
    from rollq.tasks import colours

    processor = load_processor(model_dir("tiny-vl"))
    picture = colours.picture("C", random.Random(0)).resize((size, size))
    content = [{"type": "image"}, {"type": "text", "text": colours.QUESTION}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return processor, picture, text


def stream_bytes(size: int) -> dict[str, Any]:
    from rollq.protocol import Codec
    from rollq.protocol.blobs import data_blob
    from rollq.protocol.messages import Job, Trajectory
    from rollq.workers.outputs import to_sequences

    processor, picture, text = _processor_and_picture(size)
    inputs = processor(images=[picture], text=text, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist() + [35, 2]  # the answer "A" and end of turn
    n = len(ids)
    episode = {
        "input_ids": ids,
        "loss_mask": [0] * (n - 2) + [1, 1],
        "logprobs": [0.0] * (n - 2) + [-0.5, -0.1],
        "versions": [-1] * (n - 2) + [3, 3],
        "reward": 1.0,
        "multi_modal_input": [{"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}],
        "mm_token_type_ids": inputs["mm_token_type_ids"][0].tolist() + [0, 0],
    }
    codec = Codec()
    [seq] = to_sequences(episode)
    assert seq.vision is not None

    def trajectory(vision: Any) -> int:
        s = msgspec.structs.replace(seq, vision=vision)
        return len(codec.encode(Trajectory(job_id="j", sample_index=0, n=GROUP_N, status="ok", sequences=[s])))

    by_ref = type(seq.vision)(digest=seq.vision.digest, size=seq.vision.size)
    data = {"messages": text, "images": [picture], "answer": "C"}
    inline_job = len(codec.encode(Job(job_id="j", workflow="vision_rlvr", data=data, n=GROUP_N)))
    blob = data_blob(codec, data)
    assert blob is not None
    ref_job = len(codec.encode(Job(job_id="j", workflow="vision_rlvr", data_ref=blob.digest, n=GROUP_N)))
    return {
        "picture_px": size,
        "image_tokens": int(inputs["mm_token_type_ids"].sum()),
        "pixel_values_bytes": seq.vision.size,
        "trajectory_text_only": trajectory(None),
        "trajectory_inline": trajectory(seq.vision),
        "trajectory_by_reference": trajectory(by_ref),
        "blob_store_bytes_per_sample": seq.vision.size,
        "job_group_inline": inline_job * GROUP_N,  # the group's n entries, each with the PNG
        "job_group_by_reference": ref_job * GROUP_N + len(blob.payload),  # n small entries and one stored copy
    }


def _cpu_seconds(pid: int) -> float:
    cpu = proc_cpu_s(pid)
    if cpu is None:
        raise BenchError(f"cannot read the CPU time of process {pid} (/proc/{pid}/stat)")
    return cpu


async def worker_cpu(procs: Processes, tmp: Path, jobs: int, size: int) -> dict[str, Any]:
    from rollq.engine.server.app import EngineServerConfig, serve
    from rollq.engine.server.synthetic import SyntheticBackend, SyntheticConfig
    from rollq.producer.producer import JobRequest, Producer
    from rollq.redis_client import redis_client

    processor, picture, text = _processor_and_picture(size)
    prompt_len = len(processor(images=[picture], text=text, return_tensors="pt")["input_ids"][0])
    words = processor.tokenizer.decode([35] * (prompt_len - 12))  # text of about the same token count
    backend = SyntheticBackend(SyntheticConfig(tokenizer="tiny-vl", replies=["C"]))
    engine = await serve(backend, EngineServerConfig(host="127.0.0.1", port=0))
    url = start_redis(procs, tmp)  # stopped with the benchmark's other children (run_bench)
    redis = redis_client(url)
    try:
        worker = await start_worker(
            procs, redis, url, "img", "--engine", engine.url, "--tokenizer", "tiny-vl", "--concurrency", "16"
        )
        producer = Producer(redis, "img")
        consumer = producer.consumer()
        await consumer.setup()
        kinds = {
            "text": ("rlvr", {"reward_fn": "rollq.tasks.colours:colours_reward", "tokenizer": "tiny-vl",
                              "max_new_tokens": 2}, {"messages": [{"role": "user", "content": words}], "answer": "C"}),
            "image": ("vision_rlvr", {"reward_fn": "rollq.tasks.colours:colours_reward", "processor": "tiny-vl",
                                      "max_new_tokens": 2}, {"messages": text, "images": [picture], "answer": "C"}),
        }  # fmt: skip
        out: dict[str, Any] = {"jobs": jobs, "prompt_tokens": prompt_len}
        for warm in (True, False):
            for kind, (workflow, kwargs, data) in kinds.items():
                count = 4 if warm else jobs
                reqs = [
                    JobRequest(workflow=workflow, data=data, workflow_kwargs=kwargs, job_id=f"{kind}-{warm}-{i}")
                    for i in range(count)
                ]
                before, started = _cpu_seconds(worker.pid), time.monotonic()
                await producer.submit_many(reqs)
                got = [
                    t async for t in producer.wait_for({r.job_id: 1 for r in reqs}, timeout_s=300, consumer=consumer)
                ]
                assert all(t.status == "ok" for t in got), [t.error for t in got if t.status != "ok"][:1]
                if not warm:
                    out[f"{kind}_cpu_ms_per_sample"] = round((_cpu_seconds(worker.pid) - before) / count * 1000, 3)
                    out[f"{kind}_wall_s"] = round(time.monotonic() - started, 2)
        out["image_over_text_cpu"] = round(out["image_cpu_ms_per_sample"] / out["text_cpu_ms_per_sample"], 2)
        return out
    finally:
        await redis.aclose()
        await engine.close()


async def engine_throughput(requests: int, new: int, size: int) -> dict[str, Any]:
    from rollq.engine.server.backend import GenState
    from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig
    from rollq.engine.types import SamplingParams
    from rollq.protocol.media import ImageFile, pil_to_image_file

    processor, picture, text = _processor_and_picture(size)
    backend = ReferenceBackend(ReferenceConfig(model="tiny-vl", max_running=requests, prefix_cache_tokens=0))
    await backend.start()
    try:
        prompt = processor.tokenizer(text)["input_ids"]  # one placeholder: the engine sizes it
        file: ImageFile = pil_to_image_file(picture)
        expanded, _ = backend.prepare_images(prompt, [file])
        text_prompt = [35] * len(expanded)  # the same token count, text only
        params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)

        async def batch(images: bool) -> float:
            states = []
            for i in range(requests):
                state = GenState(f"{images}-{i}-{time.monotonic_ns()}", list(prompt if images else text_prompt), params)
                if images:
                    state.input_ids, state.vision = await asyncio.to_thread(backend.prepare_images, prompt, [file])
                    state.images = [file]
                states.append(state)
            started = time.monotonic()
            await asyncio.gather(*(backend.run(s) for s in states))
            return requests * new / (time.monotonic() - started)

        await batch(True), await batch(False)  # warm
        text_tps = [await batch(False) for _ in range(3)]
        image_tps = [await batch(True) for _ in range(3)]
        best_text, best_image = max(text_tps), max(image_tps)
        return {
            "requests": requests,
            "new_tokens": new,
            "prompt_tokens": len(expanded),
            "text_tokens_per_s": round(best_text, 1),
            "image_tokens_per_s": round(best_image, 1),
            "image_over_text": round(best_image / best_text, 3),
        }
    finally:
        await backend.close()


def table(out: dict[str, Any]) -> str:
    s, w, e = out["stream_bytes"], out["worker_cpu"], out["engine"]
    rows = [
        "| measure | text | images inline | images by reference |",
        "|---|---|---|---|",
        f"| trajectory bytes in the stream | {s['trajectory_text_only']} | {s['trajectory_inline']} | "
        f"{s['trajectory_by_reference']} (+{s['blob_store_bytes_per_sample']} in the blob store) |",
        f"| a group's job bytes (n={GROUP_N}) | | {s['job_group_inline']} | {s['job_group_by_reference']} |",
        "",
        "| measure | text | image | image / text |",
        "|---|---|---|---|",
        f"| worker CPU ms per sample | {w['text_cpu_ms_per_sample']} | {w['image_cpu_ms_per_sample']} | "
        f"{w['image_over_text_cpu']} |",
        f"| engine tokens/s ({e['requests']} requests, {e['prompt_tokens']}-token prompts) | "
        f"{e['text_tokens_per_s']} | {e['image_tokens_per_s']} | {e['image_over_text']} |",
    ]
    return "\n".join(rows)


async def run_all(args: argparse.Namespace, procs: Processes, tmp: Path) -> dict[str, Any]:
    return {
        "stream_bytes": stream_bytes(args.size),
        "worker_cpu": await worker_cpu(procs, tmp, args.jobs, args.size),
        "engine": await engine_throughput(args.requests, args.new, args.size),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=56, help="picture side in pixels (56: 4 image tokens)")
    p.add_argument("--jobs", type=int, default=64, help="episodes per kind in the worker CPU measure")
    p.add_argument("--requests", type=int, default=32, help="concurrent requests in the engine measure")
    p.add_argument("--new", type=int, default=16, help="tokens each engine request generates")
    add_results_arg(p)
    args = p.parse_args(argv)
    if args.jobs < 32:  # the CPU clock (/proc) ticks in 10 ms: fewer text episodes can read as no CPU at all
        p.error("--jobs must be at least 32")

    async def run(procs: Processes, tmp: Path) -> None:
        out = await run_all(args, procs, tmp)
        print()
        print(table(out))
        print_summary(out)
        write_results("images", out, args.results, argv)

    return run_bench(run, "rollq-bench-images-")


if __name__ == "__main__":
    raise SystemExit(main())
