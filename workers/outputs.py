"""Turns what `arun_episode` returned into wire Sequences, with a clear error for anything else."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollq.protocol.arrays import Float32Array, Int32Array, UInt8Array
from rollq.protocol.messages import Sequence


class WorkflowOutputError(ValueError):
    """The workflow returned something that is not a trajectory."""


def _reward(item: Mapping[str, Any]) -> float:
    value = item.get("reward", item.get("rewards", 0.0))
    if hasattr(value, "numel"):  # torch tensor
        if value.numel() != 1:
            raise WorkflowOutputError(f"reward must be a single number, got a tensor of {value.numel()} elements")
        value = value.item()
    elif hasattr(value, "item") and getattr(value, "size", 1) == 1:  # numpy scalar
        value = value.item()
    elif isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WorkflowOutputError(f"reward must be a number, got {type(value).__name__}: {value!r:.80}")
    return float(value)


def to_sequence(item: Any) -> Sequence:
    if not isinstance(item, Mapping):
        raise WorkflowOutputError(
            f"a trajectory must be a mapping with input_ids/loss_mask/logprobs, got {type(item).__name__}"
        )
    missing = [k for k in ("input_ids", "loss_mask", "logprobs") if k not in item]
    if missing:
        raise WorkflowOutputError(
            f"trajectory lacks {', '.join(missing)} (has {', '.join(map(str, item)) or 'no keys'})"
        )
    try:
        input_ids = Int32Array.coerce(item["input_ids"], "input_ids")
        loss_mask = UInt8Array.coerce(item["loss_mask"], "loss_mask")
        logprobs = Float32Array.coerce(item["logprobs"], "logprobs")
        versions = (
            Int32Array.coerce(item["versions"], "versions")
            if item.get("versions") is not None
            else Int32Array([-1] * len(input_ids))
        )
        return Sequence(
            input_ids=input_ids, loss_mask=loss_mask, logprobs=logprobs, versions=versions, reward=_reward(item)
        )
    except ValueError as exc:
        raise WorkflowOutputError(str(exc)) from None


def to_sequences(output: Any) -> list[Sequence] | None:
    """None means the workflow rejected the sample."""
    if output is None:
        return None
    if isinstance(output, Mapping):
        return [to_sequence(output)]
    if isinstance(output, (list, tuple)):
        if not output:
            raise WorkflowOutputError("the workflow returned an empty list (return None to reject a sample)")
        return [to_sequence(item) for item in output]
    raise WorkflowOutputError(
        f"arun_episode must return a mapping, a list of mappings or None, got {type(output).__name__}"
    )
