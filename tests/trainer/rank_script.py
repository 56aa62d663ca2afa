"""Run by tests/trainer/test_ranks.py under torchrun (or alone): train a few steps on a fixed batch with however
many ranks this process group has, writing the full weights after each step, the last step's gradients and what the
shards look like. Every rank runs this file; rank 0 drives the policy and the others follow it, as in `rollq train`.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/trainer/rank_script.py \\
        --model DIR --out DIR [--steps N] [--save-after K --save CKPT] [--load CKPT] [--lora-rank R]

`--runs '[{"model": DIR, "out": DIR, "lora_rank": R}, ...]'` trains more models after that one (or instead of it,
without `--model`), one after the other in the same process group, each for `--steps` steps without checkpoints:
one torchrun start for several models (tests/trainer/test_ranks.py, the architecture families).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.` imports, as pytest has them

from rollq.trainer.batch import Batch, Group, build_batch
from rollq.trainer.config import TrainConfig
from rollq.trainer.follower import follow
from rollq.trainer.policy import Policy
from rollq.trainer.ranks import RankGroup, join_ranks
from tests.trainer.test_batch import traj

ANSWERS = [  # (answer token ids, reward): two groups of different lengths, so the ranks get unequal rows
    [([20, 21, 22], 1.0), ([300, 301, 302, 303, 304], 0.0), ([40, 41], 0.5)],
    [([7, 8, 9, 10, 11, 12, 13], 0.0), ([500], 1.0), ([60, 61, 62], 0.0)],
]


def config(model: str, lora_rank: int = 0) -> TrainConfig:
    return TrainConfig(model=model, lr=1e-3, max_tokens_per_microbatch=16, lora_rank=lora_rank, lora_alpha=16)


def fixed_batch(model: str) -> Batch:
    """The same batch for any number of ranks: behaviour logprobs from the unsharded model (rank 0 alone)."""
    plain = Policy(config(model))
    prompt = plain.tokenizer.encode("Write a number using digits only.")
    groups = []
    for g, answers in enumerate(ANSWERS):
        samples = []
        for i, (answer, reward) in enumerate(answers):
            ids = prompt + answer
            with torch.no_grad():
                lp = plain.token_logprobs(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0].tolist()
            t = traj(f"g{g}", i, ids, [0] * len(prompt) + [1] * len(answer), [0] * len(ids), reward)
            t.sequences[0].logprobs = type(t.sequences[0].logprobs)([0.0] + lp)
            samples.append(t)
        groups.append(Group(job_id=f"g{g}", samples=samples))
    return build_batch(groups, plain.pad_id)


def local_bytes(policy: Policy) -> int:
    """Bytes this rank holds of parameters, gradients and optimizer state (its shards only)."""

    def size(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    total = 0
    for p in policy.model.parameters():
        total += size(p) + (size(p.grad) if p.grad is not None else 0)
        for v in policy.optimizer.state.get(p, {}).values():
            total += size(v) if isinstance(v, torch.Tensor) and v.dim() else 0
    return total


def resume(policy: Policy, batch: Batch, checkpoint: Path, out: Path) -> None:
    """Load `checkpoint` into `policy` (model and AdamW's moments), write the loaded weights and one step's."""
    out.mkdir(parents=True, exist_ok=True)
    policy.load_checkpoint(checkpoint)
    policy.save_weights(out / "loaded")
    policy.train_step(batch)
    policy.save_weights(out / "step-1")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--runs", type=json.loads, default=None)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--save-after", type=int, default=1)
    parser.add_argument("--load", type=Path)
    parser.add_argument("--lora-rank", type=int, default=0)
    # then, in the same process group: load CKPT, write the loaded weights and one more step's to DIR (a resume on
    # this many ranks, without starting torchrun again)
    parser.add_argument("--then-load", type=Path)
    parser.add_argument("--then-out", type=Path)
    args = parser.parse_args(argv)
    jobs = [(args.model, args.out, args.lora_rank, args)] if args.model else []
    steps_only = argparse.Namespace(**{**vars(args), "save": None, "load": None, "then_load": None})
    jobs += [(r["model"], Path(r["out"]), int(r.get("lora_rank", 0)), steps_only) for r in args.runs or []]
    ranks = join_ranks("cpu", 120)
    for model_dir, out, lora_rank, job in jobs:
        train(ranks, model_dir, out, lora_rank, job)
    ranks.close()


def train(ranks: RankGroup, model_dir: str, out: Path, lora_rank: int, args: argparse.Namespace) -> None:
    """One model on these ranks, as `main`'s arguments say: rank 0 drives, the others follow until it stops them;
    each rank writes its facts into `out`."""
    policy = Policy(config(model_dir, lora_rank), ranks)
    if not ranks.leader:
        follow(policy)
        facts = {"rank": ranks.rank, "local_bytes": local_bytes(policy)}
        (out / f"rank-{ranks.rank}.json").write_text(json.dumps(facts))
        return
    out.mkdir(parents=True, exist_ok=True)
    batch = fixed_batch(model_dir)
    if args.load:  # a resume in a fresh process group
        resume(policy, batch, args.load, out)
        policy.stop_followers()
        return
    model = policy.model
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    losses = []
    for step in range(1, args.steps + 1):
        losses.append(policy.train_step(batch).loss)
        policy.save_weights(out / f"step-{step}")
        if args.save and step == args.save_after:
            policy.save_checkpoint(args.save)
    if args.then_load:
        resume(policy, batch, args.then_load, args.then_out)
    policy.stop_followers()
    facts = {"rank": 0, "world": ranks.world_size, "tied": tied, "losses": losses, "local_bytes": local_bytes(policy)}
    (out / "rank-0.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
