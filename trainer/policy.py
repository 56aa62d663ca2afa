"""The trained model: a transformers causal LM with AdamW, per-token logprobs, one decoupled-PPO step per batch,
and its weights written as safetensors for the engines (atomic: engines never see a half-written directory)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from trainer.batch import Batch
from trainer.config import TrainConfig
from trainer.loss import decoupled_ppo_loss


def model_path(name: str) -> str:
    if name == "tiny":
        from engine.tiny_model import build_tiny, default_cache_dir

        return str(build_tiny(default_cache_dir()))
    return name


class Policy:
    def __init__(self, config: TrainConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(config.seed)
        self.config = config
        self.path = model_path(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).to(config.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """log p(input_ids[:, t] | input_ids[:, :t]) for t >= 1: [N, T-1]."""
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    def train_step(self, batch: Batch) -> dict[str, Any]:
        c = self.config
        dev = c.device
        ids, attn = batch.input_ids.to(dev), batch.attention_mask.to(dev)
        mask, behav, adv = batch.loss_mask.to(dev), batch.behav_logprobs.to(dev), batch.advantages.to(dev)
        self.model.eval()
        with torch.no_grad():
            prox = self.token_logprobs(ids, attn)
        self.model.train()
        order = torch.randperm(ids.shape[0])
        stats = []
        for part in order.chunk(c.ppo_minibatches):
            logprobs = self.token_logprobs(ids[part], attn[part])
            loss, s = decoupled_ppo_loss(logprobs, prox[part], behav[part], adv[part], mask[part],
                                         clip_eps=c.clip_eps, behav_imp_cap=c.behav_imp_cap)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
            self.optimizer.step()
            stats.append((s, float(grad_norm)))
        n = len(stats)
        return {"loss": sum(s.loss for s, _ in stats) / n, "clip_fraction": sum(s.clip_fraction for s, _ in stats) / n,
                "capped_fraction": sum(s.capped_fraction for s, _ in stats) / n,
                "importance_mean": sum(s.importance_mean for s, _ in stats) / n,
                "grad_norm": sum(g for _, g in stats) / n,
                "behav_prox_gap": float(((prox - behav).abs() * mask).sum() / mask.sum().clamp(min=1))}

    def save_weights(self, directory: Path) -> Path:
        """The weights as `model.safetensors` (+ config) in `directory`, written beside it and renamed into place."""
        from safetensors.torch import save_file

        directory = Path(directory)
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tensors = {name: p.detach().to("cpu").contiguous() for name, p in self.model.named_parameters()}
        save_file(tensors, str(tmp / "model.safetensors"))
        self.model.config.to_json_file(str(tmp / "config.json"))
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
        return directory

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


__all__ = ["Policy", "model_path"]
