"""The trained model: a transformers causal LM with AdamW, per-token logprobs, one decoupled-PPO step per batch,
its weights written as safetensors for the engines (atomic: engines never see a half-written directory) and its
sharded checkpoints.

On N ranks (trainer/ranks.py) the model is sharded with FSDP2 (trainer/sharding.py) and every method below that
touches it is a collective: rank 0 calls it (the trainer loop), announcing it to the other ranks first, which run
the same method from trainer/follower.py. A step's rows are split between the ranks balanced by tokens; the loss is
a per-token mean over the whole minibatch on every rank and FSDP sums the gradients, so N ranks take the update one
process would.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch

from rollq.engine.images import vision_token_ids
from rollq.engine.models import model_dir
from rollq.protocol.messages import VisionInputs
from rollq.trainer import lora
from rollq.trainer import rank_commands as rc
from rollq.trainer.batch import Batch, micro_batches
from rollq.trainer.config import TrainConfig
from rollq.trainer.loss import LossSums, decoupled_ppo_loss
from rollq.trainer.metrics import TrainStats
from rollq.trainer.ranks import RankGroup

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


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
    vision: list[_RowImages | None] = []  # per row (a vision-language model's batch), or [] for none


class _RowImages(msgspec.Struct, kw_only=True):
    """One row's images as the model's forward takes them."""

    pixel_values: torch.Tensor  # [patches, dim]
    image_grid_thw: torch.Tensor  # [images, 3]
    types: torch.Tensor  # [T] mm_token_type_ids


def _row_images(v: VisionInputs, device: str) -> _RowImages:
    pixels = torch.frombuffer(bytearray(v.pixel_values.to_bytes()), dtype=torch.float32).view(*v.pixel_shape)
    grid = torch.frombuffer(bytearray(v.image_grid_thw.to_bytes()), dtype=torch.int32).view(-1, 3).long()
    types = torch.frombuffer(bytearray(v.mm_token_type_ids.to_bytes()), dtype=torch.uint8).long()
    return _RowImages(pixel_values=pixels.to(device), image_grid_thw=grid.to(device), types=types.to(device))


class Policy:
    def __init__(self, config: TrainConfig, ranks: RankGroup | None = None) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the run's own progress lines are what the user reads

        torch.manual_seed(config.seed)
        self.config = config
        self.ranks = ranks or RankGroup()
        self.device = self.ranks.device(config.device)
        self.path = model_dir(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        on_gpu = torch.device(self.device).type == "cuda"
        # On N ranks of GPUs FSDP's own mixed precision (bfloat16 passes, float32 reductions) replaces autocast.
        self.fsdp_mixed_precision = self.ranks.distributed and on_gpu and config.compute_dtype == "bfloat16"
        model_config = AutoConfig.from_pretrained(self.path)
        # A vision-language model (Qwen2-VL family): rows with images run through its vision tower (frozen unless
        # train_vision_tower); rollq trains it on one rank for now.
        self.takes_images = getattr(model_config, "vision_config", None) is not None
        # its placeholder tokens are never sampled (the engine's rule, engine/server/vision.py): nor counted here
        self.never_sampled = vision_token_ids(model_config) if self.takes_images else []
        self.image_token_id = int(model_config.image_token_id) if self.takes_images else None
        if self.takes_images and (self.ranks.distributed or config.lora):
            raise ValueError("a vision-language model trains on one rank, with full fine-tuning (no LoRA) for now")
        if self.ranks.distributed:
            from rollq.trainer.sharding import load_sharded

            self.model = load_sharded(self.path, self.device, mixed_precision=self.fsdp_mixed_precision)
        else:
            model_class = AutoModelForImageTextToText if self.takes_images else AutoModelForCausalLM
            model = model_class.from_pretrained(self.path, dtype=torch.float32)
            self.model = model.to(self.device)
        if self.takes_images and not config.train_vision_tower:
            # the tower frozen; its merger (the projector into the language model's embeddings) trains
            for name, param in self.model.model.visual.named_parameters():
                param.requires_grad_(name.startswith("merger."))
        if config.lora:  # a frozen base and an adapter, replicated on every rank (trainer/lora.py)
            self.model = lora.apply_lora(self.model, config, self.path)
            if self.ranks.distributed:
                lora.broadcast_adapter(lora.trainable(self.model))
        # what the optimizer moves: the adapter alone in a LoRA run, never a frozen vision tower
        self.params = [p for p in lora.trainable(self.model) if p.requires_grad]
        # fused: one kernel for the whole update on CUDA (not available on CPU)
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay, fused=on_gpu)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # One optimizer step per batch and no dropout: the proximal policy is the training pass's own weights, so
        # its logprobs are that pass's, detached (one forward pass fewer, the same update)
        self.fused_prox = config.ppo_minibatches == 1 and not has_dropout(self.model)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)

    def _announce(self, command: rc.Command) -> None:
        """Rank 0: tell the other ranks which collective comes next (a no-op on one rank; followers call the
        methods directly)."""
        if self.ranks.distributed and self.ranks.leader:
            self.ranks.announce(rc.encode(command))

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.compute_dtype == "float32" or self.fsdp_mixed_precision:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=getattr(torch, self.config.compute_dtype))

    def token_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **images: torch.Tensor
    ) -> torch.Tensor:
        """log p(input_ids[:, t] | input_ids[:, :t]) for t >= 1: [N, T-1] (float32 whatever the compute dtype).
        `images`: a vision-language model's pixel_values, image_grid_thw and mm_token_type_ids for these rows."""
        with self._autocast():
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, **images).logits[:, :-1]
        logits = logits.float()
        targets = input_ids[:, 1:]
        if not self.never_sampled:
            return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        never = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        never[self.never_sampled] = True
        logprobs = torch.log_softmax(logits.masked_fill(never, float("-inf")), dim=-1)
        logprobs = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        # the prompt's own vision tokens (never trained; a sampled one makes its group invalid): 0, not -inf
        return logprobs.masked_fill(never[targets], 0.0)

    def _logprobs_of(self, r: _Rows, rows: list[int], width: int) -> torch.Tensor:
        return self.token_logprobs(r.ids[rows, :width], r.attn[rows, :width], **self._images_of(r, rows, width))

    def _images_of(self, r: _Rows, rows: list[int], width: int) -> dict[str, torch.Tensor]:
        """The forward's image inputs for `rows` (their images in row order; none when they have none). Every row
        gets mm_token_type_ids, so the model computes each one's multimodal rope positions."""
        if not r.vision or all(r.vision[i] is None for i in rows):
            return {}
        types = torch.zeros(len(rows), width, dtype=torch.long, device=r.ids.device)
        pixels, grids = [], []
        for j, i in enumerate(rows):
            v = r.vision[i]
            if v is not None:
                types[j, : min(width, len(v.types))] = v.types[:width]
                pixels.append(v.pixel_values)
                grids.append(v.image_grid_thw)
        return {
            "pixel_values": torch.cat(pixels),
            "image_grid_thw": torch.cat(grids),
            "mm_token_type_ids": types,
        }

    def _idle_pass(self) -> torch.Tensor:
        """A pass over one 2-token row, for a rank with fewer micro-batches than another: FSDP's collectives (an
        all-gather per layer forward, a reduce-scatter backward) need every rank, so it takes part with a loss of 0."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        return self.token_logprobs(ids, torch.ones_like(ids)).sum() * 0.0

    def _micro(self, r: _Rows, rows: list[int]) -> tuple[list[list[int]], int]:
        """`rows`' micro-batches, and how many passes every rank takes (the most any rank has)."""
        mbs = micro_batches(r.lengths, rows, self.config.max_tokens_per_microbatch)
        return mbs, self.ranks.max_int(len(mbs))

    def _rows(self, batch: Batch | rc.ShardRows) -> _Rows:
        """A batch on the device, with its proximal logprobs unless the training pass gives them (`fused_prox`)."""
        if isinstance(batch, rc.ShardRows):
            ids, attn = batch.input_ids.tensor(), batch.attention_mask.tensor()
            mask, behav, adv = batch.loss_mask.tensor(), batch.behav_logprobs.tensor(), batch.advantages.tensor()
        else:
            ids, attn, mask = batch.input_ids, batch.attention_mask, batch.loss_mask
            behav, adv = batch.behav_logprobs, batch.advantages
        dev = self.device
        rows = _Rows(
            ids=ids.to(dev),
            attn=attn.to(dev),
            mask=mask.to(dev),
            behav=behav.to(dev),
            adv=adv.to(dev),
            prox=behav.to(dev).clone(),  # rows left out keep their behaviour logprobs (no gap)
            lengths=attn.sum(dim=1).tolist(),
            learning=set((adv != 0).nonzero().flatten().tolist()),
            vision=[
                None if v is None else _row_images(v, dev) for v in (batch.vision if isinstance(batch, Batch) else [])
            ],
        )
        if not self.fused_prox:
            self.model.eval()
            with torch.no_grad():
                mbs, passes = self._micro(rows, sorted(rows.learning))
                for mb in mbs:
                    w = max(rows.lengths[i] for i in mb)
                    rows.prox[mb, : w - 1] = self._logprobs_of(rows, mb, w)
                for _ in range(passes - len(mbs)):
                    self._idle_pass()
        return rows

    def _accumulate(self, r: _Rows, mbs: list[list[int]], passes: int, denominator: float, sums: LossSums) -> float:
        """Forward and backward over the micro-batches `mbs` (then idle passes up to `passes`); the loss summed."""
        c = self.config
        total = 0.0
        for mb in mbs:
            w = max(r.lengths[i] for i in mb)
            logprobs = self._logprobs_of(r, mb, w)
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
            # FSDP averages gradients over the ranks: times their number, the sum of each rank's part of the mean
            (loss * self.ranks.world_size if self.ranks.distributed else loss).backward()
            total += float(loss.detach())
            sums.add(s)
        for _ in range(passes - len(mbs)):
            self._idle_pass().backward()
        return total

    # -- a training step -------------------------------------------------------------------------------------------

    def plan(self, batch: Batch) -> tuple[list[list[int]], list[rc.Minibatch]]:
        """The step's minibatches (a random split of the rows into `ppo_minibatches`), each one's rows dealt to the
        ranks balanced by tokens (longest first, to the rank with the fewest so far). Returns each rank's rows (batch
        indices) and the minibatches over them (indices into each rank's rows)."""
        world = self.ranks.world_size
        lengths = batch.attention_mask.sum(dim=1).tolist()
        shards: list[list[int]] = [[] for _ in range(world)]
        minibatches: list[rc.Minibatch] = []
        for chunk in torch.randperm(batch.input_ids.shape[0]).chunk(self.config.ppo_minibatches):
            part: list[int] = chunk.tolist()
            load = [0] * world
            dealt: list[list[int]] = [[] for _ in range(world)]
            for i in sorted(part, key=lambda i: -lengths[i]):
                k = load.index(min(load))
                load[k] += lengths[i]
                dealt[k].append(i)
            local = []
            for k in range(world):
                local.append(list(range(len(shards[k]), len(shards[k]) + len(dealt[k]))))
                shards[k] += dealt[k]
            denominator = float(batch.loss_mask[part].sum().clamp(min=1.0))
            minibatches.append(rc.Minibatch(rows=local, denominator=denominator))
        return shards, minibatches

    def train_step(self, batch: Batch, late: Callable[[], Batch | None] | None = None) -> TrainStats:
        """One decoupled-PPO step: proximal logprobs with the current weights (a pass of their own, or with one
        optimizer step the training pass's: `fused_prox`), then `ppo_minibatches` optimizer steps, each accumulating
        gradients over length-sorted micro-batches.

        Samples whose advantage is 0 (a group whose rewards are all equal) add nothing to the gradient, so they are
        left out of both passes while still counting in the per-token mean: the same update for less compute (a
        minibatch with none left steps the optimizer on a zero gradient, as the passes would have).

        `late` (one optimizer step, one rank only): called once the batch's gradients are in, before the optimizer
        step; the rows it returns join the step, the per-token mean taken over both (the gradients so far are
        rescaled to it), the same update as one batch of both."""
        if late is not None and not self.fused_prox:
            raise ValueError("rows can join a step late only with one optimizer step per batch and no dropout")
        if late is not None and self.ranks.distributed:
            raise ValueError("rows can join a step late (join_late) only on one trainer rank")
        shards, minibatches = self.plan(batch)
        if not self.ranks.distributed:  # the rows stay where they are: the plan's indices mapped back to the batch's
            whole = [
                rc.Minibatch(rows=[[shards[0][i] for i in m.rows[0]]], denominator=m.denominator) for m in minibatches
            ]
            return self.run_step(batch, whole, late)
        packed = [_shard_rows(batch, rows) for rows in shards]
        self._announce(rc.TrainStep(shards=packed, minibatches=minibatches))
        return self.run_step(packed[self.ranks.rank], minibatches)

    def run_step(
        self,
        rows: Batch | rc.ShardRows,
        minibatches: list[rc.Minibatch],
        late: Callable[[], Batch | None] | None = None,
    ) -> TrainStats:
        """This rank's part of a step (`train_step` on rank 0; trainer/follower.py on the others)."""
        c, rank = self.config, self.ranks.rank
        r = self._rows(rows)
        self.model.train()
        sums, losses, norms = LossSums(), [], []
        gap = 0.0  # |prox - behav| over trained tokens (prox is filled by the end, whichever way it is taken)
        for minibatch in minibatches:
            part, denominator = minibatch.rows[rank], minibatch.denominator
            mbs, passes = self._micro(r, [i for i in part if i in r.learning])
            self.optimizer.zero_grad(set_to_none=passes > 0)
            if not passes:  # a zero gradient, as the passes would give: AdamW still moves on its moments
                for p in self.params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            total = self._accumulate(r, mbs, passes, denominator, sums)
            joined = late() if late is not None else None
            if joined is not None:
                j = self._rows(joined)
                both = float((r.mask[part].sum() + j.mask.sum()).clamp(min=1.0))
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(denominator / both)
                late_mbs, late_passes = self._micro(j, sorted(j.learning))
                total = total * denominator / both + self._accumulate(j, late_mbs, late_passes, both, sums)
                gap += float(((j.prox - j.behav).abs() * j.mask).sum())
            if self.config.lora and self.ranks.distributed:  # FSDP reduces only what it shards: not the adapter
                lora.all_reduce_grads(self.params)
            norms.append(_full(torch.nn.utils.clip_grad_norm_(self.params, c.grad_clip)))
            self.optimizer.step()
            losses.append(total)
        gap += float(((r.prox - r.behav).abs() * r.mask).sum())
        # Every rank's share of the sums: the figures of the whole step (the loss is each rank's part of one mean).
        summed = self.ranks.sum_floats([sums.tokens, sums.clipped, sums.capped, sums.importance, gap, *losses])
        tokens_all, clipped, capped, importance, gap = summed[:5]
        losses = summed[5:]
        tokens = max(tokens_all, 1.0)
        return TrainStats(
            loss=sum(losses) / max(1, len(losses)),
            clip_fraction=clipped / tokens,
            capped_fraction=capped / tokens,
            importance_mean=importance / max(tokens - capped, 1.0),
            grad_norm=sum(norms) / max(1, len(norms)),
            behav_prox_gap=gap / tokens,
        )

    # -- weights for the engines -----------------------------------------------------------------------------------

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Every parameter whole, one at a time, on the CPU on rank 0 (None on the other ranks, which take part in
        the gathers): a collective every rank runs to the end, in the same order."""
        if self.config.lora:  # the engines take full weights: the adapter merged into them
            yield from lora.merged_parameters(self.model, self.ranks.leader)
            return
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield name, (full.detach().to("cpu").contiguous() if self.ranks.leader else None)

    def parameter_buckets(self, bucket_bytes: int) -> Generator[list[tuple[str, torch.Tensor]]]:
        """The full parameters in buckets of about `bucket_bytes` (rank 0's; the other ranks get empty buckets):
        what is whole at once is one bucket, not the model. Always iterated to the end (a consumer that stops
        early still drains it on close, or the other ranks would wait in a gather forever)."""
        params = self.full_parameters()
        try:
            yield from buckets_of(((name, t) for name, t in params if t is not None), bucket_bytes)
            if not self.ranks.leader:
                yield []
        finally:
            for _ in params:  # the rest of the gathers, when the consumer stopped early
                pass

    def gather_weights(self, bucket_bytes: int) -> Generator[list[tuple[str, torch.Tensor]]]:
        """Rank 0: `parameter_buckets`, announced to the other ranks."""
        self._announce(rc.GatherWeights(bucket_bytes=bucket_bytes))
        return self.parameter_buckets(bucket_bytes)

    def save_weights(self, directory: Path) -> Path:
        """The weights as safetensors (+ config) in `directory`, written beside it bucket by bucket (one file per
        bucket and an index, `model.safetensors` when one bucket holds them) and renamed into place."""
        self._announce(rc.WriteWeights(directory=str(directory)))
        return self.write_weights(Path(directory))

    def write_weights(self, directory: Path) -> Path:
        bucket_bytes = int(self.config.publish_bucket_mb * (1 << 20))
        if not self.ranks.leader:
            for _ in self.parameter_buckets(bucket_bytes):
                pass
            return directory
        config = self.model.config
        return write_safetensors(
            directory, self.parameter_buckets(bucket_bytes), lambda tmp: config.to_json_file(str(tmp / "config.json"))
        )

    def save_adapter(self, directory: Path) -> Path:
        """A LoRA run's adapter in PEFT's format (rank 0 alone: every rank holds the whole adapter, no collective)."""
        if not self.config.lora:
            raise ValueError("save_adapter is for a LoRA run (lora_rank above 0)")
        return lora.write_adapter(Path(directory), self.model)

    # -- checkpoints (trainer/checkpoint.py keeps the trainer's state beside them) ---------------------------------

    def save_checkpoint(self, directory: Path) -> None:
        """Model and optimizer as a distributed checkpoint in `directory`: each rank writes its shards; readable by
        any number of ranks (`load_checkpoint` reshards)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self._announce(rc.SaveCheckpoint(directory=str(directory)))
        model, optimizer = get_state_dict(self.model, self.optimizer, options=self._state_options())
        with quiet_single_process():  # one rank saves without a process group on purpose: no warning per save
            dcp.save({"model": model, "optimizer": optimizer}, checkpoint_id=str(directory), no_dist=self._no_dist)
        if self.config.lora and self.ranks.leader:  # what the adapter is: `rollq export` rebuilds it from this
            self.model.peft_config[lora.ADAPTER_NAME].save_pretrained(str(directory))

    def load_checkpoint(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        holds_adapter = (Path(directory) / lora.ADAPTER_CONFIG).is_file()
        if holds_adapter != self.config.lora:  # before announcing: every rank raises the same, none is left waiting
            kind = "a LoRA adapter" if holds_adapter else "full weights"
            raise ValueError(
                f"checkpoint {directory} holds {kind}, and this run has lora_rank {self.config.lora_rank}: resume "
                f"with the lora settings it was trained with"
            )
        self._announce(rc.LoadCheckpoint(directory=str(directory)))
        options = self._state_options()
        model, optimizer = get_state_dict(self.model, self.optimizer, options=options)
        with quiet_single_process():  # in place: DCP fills the tensors of both state dicts
            dcp.load({"model": model, "optimizer": optimizer}, checkpoint_id=str(directory), no_dist=self._no_dist)
        set_state_dict(self.model, self.optimizer, model_state_dict=model, optim_state_dict=optimizer, options=options)

    def _state_options(self) -> Any:
        """A LoRA run's checkpoint holds the adapter and its optimizer state only: the base is the model's own
        files, unchanged (strict=False: setting it back leaves the base alone; DCP's load has already failed on any
        adapter key the checkpoint lacks)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.config.lora, strict=not self.config.lora)

    @property
    def _no_dist(self) -> bool:
        return not self.ranks.distributed

    def stop_followers(self) -> None:
        """Rank 0, at the end of the run: the other ranks return from trainer/follower.py."""
        self._announce(rc.Stop())


def buckets_of(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`named` tensors in buckets of about `bucket_bytes` (a bucket closes once it reaches them; none is empty)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def write_safetensors(
    directory: Path, buckets: Iterable[list[tuple[str, torch.Tensor]]], write_config: Callable[[Path], None]
) -> Path:
    """Weights as the engines load them: written beside `directory` bucket by bucket (one file per bucket and an
    index, `model.safetensors` when one bucket holds them), `write_config(folder)` adding its config, then renamed
    into place, so an engine never sees a half-written directory (Policy.write_weights, rollq.trainer.seam)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files: list[tuple[Path, list[str]]] = []
    for i, bucket in enumerate(buckets):
        path = tmp / f"part-{i}.safetensors"
        save_file(dict(bucket), str(path))
        files.append((path, [name for name, _ in bucket]))
    if len(files) == 1:
        files[0][0].rename(tmp / WEIGHTS_FILE)
    else:
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(files):
            final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            path.rename(tmp / final)
            weight_map.update(dict.fromkeys(names, final))
        (tmp / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_config(tmp)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every save and load of one process that it assumes one process: the single-rank trainer and
    `rollq export` are exactly that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _shard_rows(batch: Batch, rows: list[int]) -> rc.ShardRows:
    """`rows` of `batch`, cut to the longest of them."""
    width = int(batch.attention_mask[rows].sum(dim=1).max()) if rows else 2
    pick = torch.tensor(rows, dtype=torch.long)
    return rc.ShardRows(
        input_ids=rc.PackedTensor.of(batch.input_ids[pick, :width]),
        attention_mask=rc.PackedTensor.of(batch.attention_mask[pick, :width]),
        loss_mask=rc.PackedTensor.of(batch.loss_mask[pick, : width - 1]),
        behav_logprobs=rc.PackedTensor.of(batch.behav_logprobs[pick, : width - 1]),
        advantages=rc.PackedTensor.of(batch.advantages[pick]),
    )


def _full(norm: torch.Tensor) -> float:
    """A gradient norm as a float (a DTensor's, over every rank's shards, under FSDP)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether training-mode passes are noisy (a dropout module or a config dropout above 0)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    settings = config.to_dict() if config is not None else {}
    return any("dropout" in k and isinstance(v, int | float) and v > 0 for k, v in settings.items())


__all__ = ["WEIGHTS_FILE", "WEIGHTS_INDEX", "Policy", "buckets_of", "has_dropout", "write_safetensors"]
