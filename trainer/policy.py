"""The trained model: a transformers causal LM with AdamW, per-token logprobs, one decoupled-PPO step per batch,
and its weights written as safetensors for the engines (atomic: engines never see a half-written directory)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from rollq.engine.tiny_model import model_dir
from rollq.trainer.batch import Batch, micro_batches
from rollq.trainer.config import TrainConfig
from rollq.trainer.loss import LossSums, decoupled_ppo_loss
from rollq.trainer.metrics import TrainStats


class _Rows(msgspec.Struct, kw_only=True):
    """A batch's tensors on the device, for one step's passes."""

    ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    behav: torch.Tensor
    adv: torch.Tensor
    prox: torch.Tensor  # proximal logprobs: filled before the passes, or by them (fused_prox)
    lengths: list[int]
    learning: set[int]  # rows with an advantage: the only ones through the passes


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
        self.model = model.to(config.device)
        # fused: one kernel for the whole update on CUDA (not available on CPU)
        fused = torch.device(config.device).type == "cuda"
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay, fused=fused
        )
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # One optimizer step per batch and no dropout: the proximal policy is the training pass's own weights, so
        # its logprobs are that pass's, detached (one forward pass fewer, the same update)
        self.fused_prox = config.ppo_minibatches == 1 and not has_dropout(self.model)
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

    def _rows(self, batch: Batch) -> _Rows:
        """A batch on the device, with its proximal logprobs unless the training pass gives them (`fused_prox`)."""
        c, dev = self.config, self.config.device
        rows = _Rows(
            ids=batch.input_ids.to(dev),
            attn=batch.attention_mask.to(dev),
            mask=batch.loss_mask.to(dev),
            behav=batch.behav_logprobs.to(dev),
            adv=batch.advantages.to(dev),
            prox=batch.behav_logprobs.to(dev).clone(),  # rows left out keep their behaviour logprobs (no gap)
            lengths=batch.attention_mask.sum(dim=1).tolist(),
            learning=set((batch.advantages != 0).nonzero().flatten().tolist()),
        )
        if not self.fused_prox:
            self.model.eval()
            with torch.no_grad():
                for mb in micro_batches(rows.lengths, sorted(rows.learning), c.max_tokens_per_microbatch):
                    w = max(rows.lengths[i] for i in mb)
                    rows.prox[mb, : w - 1] = self._logprobs_of(rows.ids, rows.attn, mb, w)
        return rows

    def _accumulate(self, r: _Rows, active: list[int], denominator: torch.Tensor, sums: LossSums) -> float:
        """Forward and backward over `active` rows in length-sorted micro-batches; the loss summed over them."""
        c = self.config
        total = 0.0
        for mb in micro_batches(r.lengths, active, c.max_tokens_per_microbatch):
            w = max(r.lengths[i] for i in mb)
            logprobs = self._logprobs_of(r.ids, r.attn, mb, w)
            if self.fused_prox:
                r.prox[mb, : w - 1] = logprobs.detach()
            loss, s = decoupled_ppo_loss(
                logprobs,
                r.prox[mb, : w - 1],
                r.behav[mb, : w - 1],
                r.adv[mb],
                r.mask[mb, : w - 1],
                clip_eps=c.clip_eps,
                behav_imp_cap=c.behav_imp_cap,
                denominator=denominator,
            )
            loss.backward()
            total += float(loss.detach())
            sums.add(s)
        return total

    def train_step(self, batch: Batch, late: Callable[[], Batch | None] | None = None) -> TrainStats:
        """One decoupled-PPO step: proximal logprobs with the current weights (a pass of their own, or with one
        optimizer step the training pass's: `fused_prox`), then `ppo_minibatches` optimizer steps, each accumulating
        gradients over length-sorted micro-batches.

        Samples whose advantage is 0 (a group whose rewards are all equal) add nothing to the gradient, so they are
        left out of both passes while still counting in the per-token mean: the same update for less compute (a
        minibatch with none left steps the optimizer on a zero gradient, as the passes would have).

        `late` (one optimizer step only): called once the batch's gradients are in, before the optimizer step; the
        rows it returns join the step, the per-token mean taken over both (the gradients so far are rescaled to it),
        the same update as one batch of both."""
        c = self.config
        if late is not None and not self.fused_prox:
            raise ValueError("rows can join a step late only with one optimizer step per batch and no dropout")
        r = self._rows(batch)
        self.model.train()
        sums, losses, norms = LossSums(), [], []
        gap = 0.0  # |prox - behav| over trained tokens (prox is filled by the end, whichever way it is taken)
        for chunk in torch.randperm(r.ids.shape[0]).chunk(c.ppo_minibatches):
            part: list[int] = chunk.tolist()
            denominator = r.mask[part].sum().clamp(min=1.0)
            active = [i for i in part if i in r.learning]
            self.optimizer.zero_grad(set_to_none=bool(active))
            if not active:  # a zero gradient, as the passes would give: AdamW still moves on its moments
                for p in self.model.parameters():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            total = self._accumulate(r, active, denominator, sums)
            joined = late() if late is not None else None
            if joined is not None:
                j = self._rows(joined)
                both = (r.mask[part].sum() + j.mask.sum()).clamp(min=1.0)
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(denominator / both)
                total = total * float(denominator / both) + self._accumulate(j, sorted(j.learning), both, sums)
                gap += float(((j.prox - j.behav).abs() * j.mask).sum())
            norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)))
            self.optimizer.step()
            losses.append(total)
        gap += float(((r.prox - r.behav).abs() * r.mask).sum())
        tokens = max(sums.tokens, 1.0)
        return TrainStats(
            loss=sum(losses) / max(1, len(losses)),
            clip_fraction=sums.clipped / tokens,
            capped_fraction=sums.capped / tokens,
            importance_mean=sums.importance / max(tokens - sums.capped, 1.0),
            grad_norm=sum(norms) / max(1, len(norms)),
            behav_prox_gap=gap / tokens,
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


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether training-mode passes are noisy (a dropout module or a config dropout above 0)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    settings = config.to_dict() if config is not None else {}
    return any("dropout" in k and isinstance(v, int | float) and v > 0 for k, v in settings.items())


__all__ = ["Policy", "has_dropout"]
