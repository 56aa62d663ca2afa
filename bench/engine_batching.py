"""Decode throughput of the reference engine's continuous batching vs sequential `model.generate`, same prompts.

    python -m bench.engine_batching            # from the repo root
    python -m bench.engine_batching --quick    # smoke run

Both sides run the same model (the tiny offline model unless --model names an HF directory) with the same torch
thread count. `--concurrency` requests (chat-templated prompts of varied lengths) are submitted at once to a started
`ReferenceBackend` (greedy unless --temperature, ignore_eos, `--max-new-tokens` each); the baseline runs
`model.generate` on each prompt in turn (same decoding, EOS disabled), so both produce the same number of tokens.
Greedy outputs are compared too. The last line printed is a JSON summary.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401  (run as `python bench/engine_batching.py`: the repository root on sys.path)

import argparse
import asyncio
import statistics
import time
from typing import TYPE_CHECKING, Any

from bench.common import print_summary
from bench.results import add_results_arg, write_results
from rollq.engine.server.backend import GenState
from rollq.engine.types import SamplingParams

if TYPE_CHECKING:  # imported in amain: `--help` does not load torch
    from rollq.engine.server.reference import ReferenceBackend

QUESTIONS = [
    "What is 2 + 2?",
    "Solve for x: 3x + 5 = 20.",
    "If a train travels 60 miles per hour for 3 hours, how far does it travel? Explain each step.",
    "Write a Python function that returns the sum of a list of numbers.",
    "What is the capital of France?",
    "Find the weather in Paris and in London for tomorrow, then compare them.",
]


def make_prompts(backend: ReferenceBackend, n: int) -> list[list[int]]:
    tok = backend.tokenizer
    prompts = []
    for i in range(n):
        question = " ".join([QUESTIONS[i % len(QUESTIONS)]] * (1 + i % 4))  # lengths vary ~4x
        messages = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": question},
        ]
        prompts.append(list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]))
    return prompts


async def run_batched(
    backend: ReferenceBackend, prompts: list[list[int]], max_new: int, temperature: float
) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_new_tokens=max_new, temperature=temperature, ignore_eos=True)
    states = [GenState(f"bench-{i}", p, params) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    await asyncio.gather(*(backend.run(s) for s in states))
    return time.perf_counter() - t0, [s.output_ids for s in states]


def run_sequential(
    model: Any, prompts: list[list[int]], max_new: int, temperature: float
) -> tuple[float, list[list[int]]]:
    import torch
    from transformers import GenerationConfig

    sampled = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {}
    gen = GenerationConfig(max_new_tokens=max_new, pad_token_id=0, **({"do_sample": False} | sampled))
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # same token count as ignore_eos on the batched side
    outputs = []
    try:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for p in prompts:
                out = model.generate(torch.tensor([p]), generation_config=gen)
                outputs.append(out[0, len(p) :].tolist())
        return time.perf_counter() - t0, outputs
    finally:
        model.generation_config.eos_token_id = saved


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    from rollq.engine.server.reference import ReferenceBackend, ReferenceConfig

    backend = ReferenceBackend(
        ReferenceConfig(model=args.model, max_running=max(64, args.concurrency), torch_threads=args.threads)
    )
    await backend.start()
    try:
        import torch

        prompts = make_prompts(backend, args.concurrency)
        temp = args.temperature
        await run_batched(backend, prompts[:2], 4, temp)  # warm-up
        run_sequential(backend.model, prompts[:1], 4, temp)
        batched, sequential, ratios, same = [], [], [], 0
        for _ in range(args.repeat):
            tb, out_b = await run_batched(backend, prompts, args.max_new_tokens, temp)
            ts, out_s = run_sequential(backend.model, prompts, args.max_new_tokens, temp)
            batched.append(sum(map(len, out_b)) / tb)
            sequential.append(sum(map(len, out_s)) / ts)
            ratios.append(batched[-1] / sequential[-1])
            same = sum(a == b for a, b in zip(out_b, out_s, strict=True))
            print(
                f"batched {batched[-1]:,.0f} tok/s ({tb:.2f} s)  "
                f"sequential {sequential[-1]:,.0f} tok/s ({ts:.2f} s)  "
                f"ratio {ratios[-1]:.2f}" + (f"  greedy outputs equal {same}/{len(prompts)}" if temp == 0 else ""),
                file=sys.stderr,
            )
        b, s = statistics.median(batched), statistics.median(sequential)
        return {
            "bench": "engine_batching",
            "model": backend.model_path,
            "concurrency": args.concurrency,
            "max_new_tokens": args.max_new_tokens,
            "temperature": temp,
            "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
            "torch_threads": torch.get_num_threads(),
            "batched_tok_s": round(b, 1),
            "sequential_tok_s": round(s, 1),
            "ratio": round(statistics.median(ratios), 2),
            "greedy_equal": f"{same}/{len(prompts)}" if temp == 0 else None,
            "repeat": args.repeat,
        }
    finally:
        await backend.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.engine_batching", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny' (default) or an HF model directory")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else plain sampling")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the backend's default)")
    p.add_argument("--repeat", type=int, default=1, help="measurements; medians are reported")
    p.add_argument("--quick", action="store_true", help="smoke run: concurrency 8, 16 new tokens")
    add_results_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.max_new_tokens = 8, 16
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = asyncio.run(amain(args))
    print_summary(summary)
    write_results("engine_batching", summary, args.results, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
