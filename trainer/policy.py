"""The trained model: a transformers causal LM with AdamW, per-token logprobs, one decoupled-PPO step per batch,
and its weights written as safetensors for the engines (atomic: engines never see a half-written directory)."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from rollq.engine.tiny_model import model_dir
from rollq.trainer.batch import Batch, micro_batches
from rollq.trainer.config import TrainConfig
from rollq.trainer.loss import LossSums, decoupled_ppo_loss
from rollq.trainer.metrics import TrainStats


class Policy:
    def __init__(self, config: TrainConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the run's own progress lines are what the user reads

        torch.manual_seed(config.seed)
        self.config = config
        self.path = model_dir(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)
        self.model = model.to(config.device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) hides self
        # fused: one kernel for the whole update on CUDA (not available on CPU)
        fused = torch.device(config.device).type == "cuda"
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay, fused=fused
        )
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.compute_dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.config.device).type, dtype=getattr(torch, self.config.compute_dtype))

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """log p(input_ids[:, t] | input_ids[:, :t]) for t >= 1: [N, T-1] (float32 whatever the compute dtype)."""
        with self._autocast():
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        logits = logits.float()
        return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    def _logprobs_of(self, ids: torch.Tensor, attn: torch.Tensor, rows: list[int], width: int) -> torch.Tensor:
        return self.token_logprobs(ids[rows, :width], attn[rows, :width])

    def train_step(self, batch: Batch) -> TrainStats:
        """One decoupled-PPO step: proximal logprobs with the current weights, then `ppo_minibatches` optimizer
        steps, each accumulating gradients over length-sorted micro-batches.

        Samples whose advantage is 0 (a group whose rewards are all equal) add nothing to the gradient, so they are
        left out of both passes while still counting in the per-token mean: the same update for less compute (a
        minibatch with none left steps the optimizer on a zero gradient, as the passes would have)."""
        c = self.config
        dev = c.device
        ids, attn = batch.input_ids.to(dev), batch.attention_mask.to(dev)
        mask, behav, adv = batch.loss_mask.to(dev), batch.behav_logprobs.to(dev), batch.advantages.to(dev)
        lengths = attn.sum(dim=1).tolist()
        rows = list(range(ids.shape[0]))
        learning = set((adv != 0).nonzero().flatten().tolist())
        self.model.eval()
        prox = behav.clone()  # rows left out keep their behaviour logprobs (no gap reported for them)
        with torch.no_grad():
            for mb in micro_batches(lengths, sorted(learning), c.max_tokens_per_microbatch):
                w = max(lengths[i] for i in mb)
                prox[mb, : w - 1] = self._logprobs_of(ids, attn, mb, w)
        self.model.train()
        sums, losses, norms = LossSums(), [], []
        for chunk in torch.randperm(len(rows)).chunk(c.ppo_minibatches):
            part: list[int] = chunk.tolist()
            denominator = mask[part].sum().clamp(min=1.0)
            active = [i for i in part if i in learning]
            self.optimizer.zero_grad(set_to_none=bool(active))
            if not active:  # a zero gradient, as the passes would give: AdamW still moves on its moments
                for p in self.model.parameters():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            total = 0.0
            for mb in micro_batches(lengths, active, c.max_tokens_per_microbatch):
                w = max(lengths[i] for i in mb)
                loss, s = decoupled_ppo_loss(
                    self._logprobs_of(ids, attn, mb, w),
                    prox[mb, : w - 1],
                    behav[mb, : w - 1],
                    adv[mb],
                    mask[mb, : w - 1],
                    clip_eps=c.clip_eps,
                    behav_imp_cap=c.behav_imp_cap,
                    denominator=denominator,
                )
                loss.backward()
                total += float(loss.detach())
                sums.add(s)
            norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)))
            self.optimizer.step()
            losses.append(total)
        tokens = max(sums.tokens, 1.0)
        return TrainStats(
            loss=sum(losses) / max(1, len(losses)),
            clip_fraction=sums.clipped / tokens,
            capped_fraction=sums.capped / tokens,
            importance_mean=sums.importance / max(tokens - sums.capped, 1.0),
            grad_norm=sum(norms) / max(1, len(norms)),
            behav_prox_gap=float(((prox - behav).abs() * mask).sum() / max(sums.tokens, 1.0)),
        )

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


__all__ = ["Policy"]
