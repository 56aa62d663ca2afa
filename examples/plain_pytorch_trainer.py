"""Train rollq's tiny model on `toy:digits` with a plain PyTorch loop: rollq feeds the queue, keeps the staleness
bound and exactly-once, and moves the engines to the weights this loop hands back (rollq.trainer.seam,
docs/byo-trainer.md). The loop is ordinary PyTorch: a forward pass, a clipped policy-gradient loss, AdamW.

Against a running stack (Redis, engines and workers for the run; CONTRIBUTING.md starts one on this machine):

    ROLLQ_RUN=byo python examples/plain_pytorch_trainer.py [CONFIG.yaml] steps=100 'engine=[http://127.0.0.1:30000]'

KEY=VALUE pairs (and the config file's `trainer` section, ROLLQ_TRAINER_* variables) are `rollq train`'s settings.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rollq.config import load, overrides
from rollq.engine.models import model_dir
from rollq.trainer.config import TrainConfig
from rollq.trainer.metrics import StepRecord
from rollq.trainer.seam import SyncRolloutSession

CLIP = 0.2  # PPO's clip of the ratio to the policy that generated the tokens


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p(token t | tokens < t) for t >= 1: [N, T-1], aligned with the batch's per-token columns."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def policy_loss(
    logprobs: torch.Tensor, behav_logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """PPO's clipped objective against the behaviour policy (the engines' logprobs), a mean over trained tokens."""
    ratio = torch.exp(logprobs - behav_logprobs)
    per_token = -torch.min(ratio * advantages[:, None], ratio.clamp(1 - CLIP, 1 + CLIP) * advantages[:, None])
    return (per_token * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


def train(cfg: TrainConfig) -> Iterator[tuple[float, StepRecord, torch.nn.Module]]:
    """Train `cfg.steps` steps; yields each step's loss, rollq's metrics line and the model."""
    torch.manual_seed(cfg.seed)
    device = cfg.device
    model = AutoModelForCausalLM.from_pretrained(model_dir(cfg.model), dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    def save(directory: Path) -> None:  # inside rollq's checkpoint: a restart resumes both together
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, directory / "state.pt")

    def restore(directory: Path) -> None:
        state = torch.load(directory / "state.pt", map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    with SyncRolloutSession(cfg, model, save_checkpoint=save, load_checkpoint=restore) as session:
        for batch in session.batches():
            ids, attention = batch.input_ids.to(device), batch.attention_mask.to(device)
            mask, behav, advantages = (t.to(device) for t in (batch.loss_mask, batch.behav_logprobs, batch.advantages))
            model.train()
            loss = policy_loss(token_logprobs(model, ids, attention), behav, advantages, mask)
            optimizer.zero_grad()
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            optimizer.step()
            record = session.publish(model, batch.version + 1, loss=loss.item(), grad_norm=grad_norm)
            yield loss.item(), record, model


if __name__ == "__main__":
    args = sys.argv[1:]
    path = args.pop(0) if args and "=" not in args[0] else None
    config = load(TrainConfig, "trainer", path, given=overrides(TrainConfig, args))
    for loss, record, _ in train(config):
        print(f"step {record.step}: version {record.version}  reward {record.reward_mean:.3f}  loss {loss:.4f}")
