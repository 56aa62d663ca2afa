"""`rollq export`: a trained run's model as a Hugging Face model directory, for serving (transformers, SGLang,
`rollq engine --model DIR`).

The run's latest checkpoint (RUN_DIR/checkpoints/, trainer/checkpoint.py: a distributed checkpoint, written by any
number of ranks) holds the trained weights but not the model's config or tokenizer: those come from the base model
the run trained (`tiny`, `smollm2` or an HF directory; recorded in the checkpoint). This process reads every shard
into the one model.
The export is the base model with the trained weights loaded (strictly), saved as safetensors with the base's
tokenizer (chat template included) and generation config, plus `rollq_export.json` (where it came from). It is
written beside `out` and renamed into place, so a reader never sees half of one.

torch and transformers are imported inside the functions: `rollq --help` must not pay for them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

from rollq.config import Settings, setting

MARKER = "rollq_export.json"  # written into every export: an `out` holding one may be replaced


class ExportConfig(Settings, kw_only=True):
    """Write a trained run's model as a Hugging Face model directory."""

    run_dir: Annotated[str, setting("the run directory holding checkpoints/ (the trainer's run_dir)", positional=True)]
    out: Annotated[
        str,
        setting(
            "the model directory to write (a previous export there is replaced; anything else is refused)",
            metavar="DIR",
        ),
    ]
    model: Annotated[
        str,
        setting(
            "the base model the run trained: `tiny`, `smollm2` or an HF model directory ('' = the one the "
            "checkpoint records)",
            metavar="MODEL",
        ),
    ] = ""
    dtype: Annotated[
        Literal["float32", "bfloat16"], setting("dtype of the exported weights (training keeps float32)")
    ] = "float32"
    merged: Annotated[
        bool,
        setting(
            "a LoRA run: write the base model with the adapter merged in (a full model directory) instead of the "
            "adapter in PEFT's format"
        ),
    ] = False


class ExportError(ValueError):
    """An export that can't be made; the message says why in one line."""


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _is_export(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not _is_export(out):
        raise ExportError(f"--out {out} is not empty and holds no previous rollq export ({MARKER}); choose another")


def _mismatch(exc: Exception, model: str) -> ExportError:
    return ExportError(
        f"the checkpoint's weights do not match base model {model!r}: give --model the model the run trained "
        f"({_one_line(str(exc), 240)})"
    )


def export_run(
    run_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    model: str = "",
    dtype: str = "float32",
    merged: bool = False,
) -> Path:
    """Write the model of the run in `run_dir` (its latest checkpoint) as an HF model directory at `out`; returns `out`.
    `model`: the base model ('' = the one the checkpoint records). A LoRA run's checkpoint is written as its adapter
    in PEFT's format, or with `merged` as the base model with the adapter merged in. Raises ExportError with a
    one-line message."""
    run_dir, out = Path(run_dir).expanduser(), Path(out).expanduser()
    if dtype not in ("float32", "bfloat16"):
        raise ExportError(f"--dtype must be float32 or bfloat16, not {dtype!r}")
    from rollq.trainer import checkpoint

    path = checkpoint.latest(run_dir)
    if path is None:
        raise ExportError(
            f"no checkpoint in {run_dir} ({checkpoint.CHECKPOINTS}/; the trainer writes one every checkpoint_every "
            "steps)"
        )
    _check_out(out)  # both before torch is imported: a mistyped path fails at once
    try:
        state = checkpoint.read_state(path)
    except Exception as exc:  # a foreign or damaged file
        raise ExportError(f"cannot read {path}: {_one_line(str(exc) or type(exc).__name__, 200)}") from None

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from rollq.engine.models import model_dir
    from rollq.trainer.policy import quiet_single_process

    hf_logging.disable_progress_bar()
    base = model or state.model
    if not base:
        raise ExportError(
            f"{path} does not record its base model (an older checkpoint): give --model (tiny, smollm2 or the HF "
            "model directory the run trained)"
        )
    try:
        base_dir = model_dir(base)
        net = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
    except (OSError, ValueError, ImportError) as exc:
        raise ExportError(f"cannot load base model {base!r}: {_one_line(str(exc), 200)}") from None
    from rollq.trainer import lora

    adapter = (path / lora.ADAPTER_CONFIG).is_file()
    if merged and not adapter:
        raise ExportError(f"--merged is for a LoRA run, and {path} holds full weights (export it without --merged)")
    try:
        options = StateDictOptions(ignore_frozen_params=adapter, strict=not adapter)
        if adapter:  # the checkpoint holds the adapter alone: it goes onto the base model as it was trained
            from peft import LoraConfig, get_peft_model

            net = get_peft_model(net, LoraConfig.from_pretrained(str(path)))
        weights = get_model_state_dict(net, options=options)
        with quiet_single_process():  # every weight of the model (or of the adapter), or an error
            dcp.load({"model": weights}, checkpoint_id=str(path), no_dist=True)
        set_model_state_dict(net, weights, options=options)
    except (Exception, CheckpointException) as exc:  # a missing key, another model's shape, a damaged shard
        # DCP's message carries each rank's traceback: its last line is the reason
        reason = [line for line in str(exc).splitlines() if line.strip()][-1:] or [type(exc).__name__]
        raise _mismatch(Exception(reason[0]), base) from None
    if adapter and merged:
        net = net.merge_and_unload()
    if dtype != "float32":
        net = net.to(getattr(torch, dtype))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        net.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if (base_dir / "generation_config.json").is_file():
            shutil.copyfile(base_dir / "generation_config.json", tmp / "generation_config.json")
        record: dict[str, Any] = {
            "run_dir": str(run_dir.resolve()),
            "step": state.step,
            "version": state.version,
            "model": base,
            "base_dir": str(Path(base_dir).resolve()),
            "dtype": dtype,
            "lora": "merged" if adapter and merged else "adapter" if adapter else "none",
        }
        (tmp / MARKER).write_text(json.dumps(record, indent=1) + "\n")
        follow_umask(tmp)
        _check_out(out)  # again: another writer may have filled it meanwhile
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _umask() -> int:
    mask = os.umask(0o022)  # reading it means setting it: put back at once (a one-thread command)
    os.umask(mask)
    return mask


def follow_umask(root: Path) -> None:
    """The export readable like any file the user writes (0755 / 0644 under umask 022), by a server running as
    another user or in a container: mkdtemp made its directory 0700, and writers may make files 0600. Nothing in it
    is secret (the run's checkpoints and keys stay where they are)."""
    mask = _umask()
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o777 & ~mask)
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def _replace(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; a previous export there goes away (and stays if the rename fails)."""
    if out.is_dir() and any(out.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, old)  # onto an empty directory: rename(2) replaces it
        try:
            os.replace(tmp, out)
        except OSError:
            os.replace(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)  # onto nothing or an empty directory


def export(cfg: ExportConfig) -> int:
    """The `rollq export` entry: one JSON line on success, one `rollq export: ...` line and exit 2 otherwise."""
    try:
        out = export_run(cfg.run_dir, cfg.out, cfg.model, cfg.dtype, cfg.merged)
    except ExportError as exc:
        print(f"rollq export: {exc}", file=sys.stderr)
        return 2
    record = json.loads((out / MARKER).read_text())
    print(
        json.dumps({"out": str(out), "step": record["step"], "version": record["version"], "model": record["model"]}),
        flush=True,
    )
    return 0


__all__ = ["ExportConfig", "ExportError", "export", "export_run"]
