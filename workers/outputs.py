"""Turns what `arun_episode` returned into wire Sequences, with a clear error for anything else.

Accepted, besides rollq's own mapping (input_ids, loss_mask, logprobs[, versions, reward]): AReaL's tensor dict
(`[1, L]` tensors, `rewards`, `attention_mask`: only the positions it marks are kept) and the short template of
AReaL's add-a-workflow guide, `{"input_ids": prompt, "output_ids": generated, "reward": r}`, whose loss mask,
logprobs and versions come from the engine response of this episode with exactly those prompt and output ids.
And what AReaL's OpenAI client exports (`client.export_interactions(...)`: `{completion id: interaction}`), by its
shape: a mapping whose values all have `to_tensor_dict()` (rollq.workers.areal_openai's interactions, and AReaL's own)
is one trajectory per value, in order.

A vision-language workflow's `multi_modal_input` (AReaL's: a list of one dict with the processor's `pixel_values` and
`image_grid_thw`) and `mm_token_type_ids` become the sequence's VisionInputs, carried inline here (the worker moves
large ones to the run's blob store before publishing).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any

from rollq.engine.types import ModelResponse
from rollq.protocol.arrays import Float32Array, Int32Array, UInt8Array
from rollq.protocol.blobs import digest_of
from rollq.protocol.codec import Codec
from rollq.protocol.messages import Sequence, VisionInputs, VisionRef

# What a trajectory mapping may hold (rollq's, AReaL's tensor dict's and its template's keys).
TRAJECTORY_KEYS = frozenset(
    {"input_ids", "loss_mask", "logprobs", "versions", "reward", "rewards", "attention_mask", "output_ids"}
    | {"multi_modal_input", "mm_token_type_ids"}
)
VISION_KEYS = frozenset({"pixel_values", "image_grid_thw"})  # what a multi_modal_input dict may hold


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


def _ids(value: Any, field: str) -> list[int]:
    try:
        return list(Int32Array.coerce(value, field))
    except ValueError as exc:
        raise WorkflowOutputError(str(exc)) from None


def _check_batch(item: Mapping[str, Any]) -> None:
    shape = getattr(item.get("input_ids"), "shape", None)
    if shape is not None and len(shape) == 2 and shape[0] > 1:
        raise WorkflowOutputError(
            f"input_ids: expected a 1-D array, got shape {tuple(shape)}: a trajectory is one sample ([L] or [1, L]); "
            "return a list of mappings for several sequences (a group's n samples are n jobs, Job.n)"
        )


def _from_template(item: Mapping[str, Any], responses: Seq[ModelResponse], used: set[int]) -> dict[str, Any]:
    """`{"input_ids": prompt, "output_ids": generated, "reward": r}` -> a full trajectory, from the response the
    engine returned for exactly that prompt and output in this episode."""
    prompt, output = _ids(item["input_ids"], "input_ids"), _ids(item["output_ids"], "output_ids")
    for i, resp in enumerate(responses):
        if i not in used and resp.input_tokens == prompt and resp.output_tokens == output:
            used.add(i)
            n_prompt = len(prompt)
            return {
                "input_ids": prompt + output,
                "loss_mask": [0] * n_prompt + [1] * len(output),
                "logprobs": [0.0] * n_prompt + list(resp.output_logprobs),
                "versions": [-1] * n_prompt + list(resp.output_versions),
                "reward": item.get("reward", item.get("rewards", 0.0)),
            }
    seen = "; ".join(f"prompt {len(r.input_tokens)} + output {len(r.output_tokens)} tokens" for r in responses)
    raise WorkflowOutputError(
        f"output_ids ({len(output)} tokens after a {len(prompt)}-token prompt) match no engine response of this "
        f"episode ({len(responses)} responses{': ' + seen if seen else ''}): input_ids must be a response's "
        "input_tokens and output_ids its output_tokens, unchanged (or return loss_mask and logprobs yourself)"
    )


def _masked(item: Mapping[str, Any]) -> Mapping[str, Any]:
    """Keep only the positions `attention_mask` marks (AReaL's valid-token mask)."""
    mask = item.get("attention_mask")
    if mask is None:
        return item
    try:
        keep = list(UInt8Array.coerce(mask, "attention_mask"))
    except ValueError as exc:
        raise WorkflowOutputError(str(exc)) from None
    if all(keep):
        return item
    out = dict(item)
    for key in ("input_ids", "loss_mask", "logprobs", "versions", "mm_token_type_ids"):
        value = item.get(key)
        if value is None:
            continue
        column = value.tolist() if hasattr(value, "tolist") else list(value)
        if column and isinstance(column[0], list) and len(column) == 1:  # [1, L]
            column = column[0]
        if len(column) != len(keep):
            raise WorkflowOutputError(f"attention_mask has {len(keep)} entries but {key} has {len(column)}")
        out[key] = [v for v, k in zip(column, keep, strict=True) if k]
    return out


def to_sequence(item: Any, responses: Seq[ModelResponse] = (), used: set[int] | None = None) -> Sequence:
    if not isinstance(item, Mapping):
        raise WorkflowOutputError(
            f"a trajectory must be a mapping with input_ids/loss_mask/logprobs, got {type(item).__name__}"
        )
    _check_batch(item)
    if "output_ids" in item and "loss_mask" not in item and "input_ids" in item:
        item = _from_template(item, responses, used if used is not None else set())
    missing = [k for k in ("input_ids", "loss_mask", "logprobs") if k not in item]
    if missing:
        raise WorkflowOutputError(
            f"trajectory lacks {', '.join(missing)} (has {', '.join(map(str, item)) or 'no keys'})"
        )
    unknown = sorted(str(k) for k in item if k not in TRAJECTORY_KEYS)
    if unknown:  # dropping them would train on less than the workflow returned, silently
        raise WorkflowOutputError(
            f"trajectory has keys rollq does not carry: {', '.join(unknown)} (it carries "
            f"{', '.join(sorted(TRAJECTORY_KEYS))})"
        )
    item = _masked(item)
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
            input_ids=input_ids,
            loss_mask=loss_mask,
            logprobs=logprobs,
            versions=versions,
            reward=_reward(item),
            vision=_vision(item, len(input_ids)),
        )
    except ValueError as exc:
        raise WorkflowOutputError(str(exc)) from None


def _vision(item: Mapping[str, Any], length: int) -> VisionRef | None:
    """The sequence's `multi_modal_input` + `mm_token_type_ids` as an inline VisionRef (None without images)."""
    mm, types = item.get("multi_modal_input"), item.get("mm_token_type_ids")
    if mm is None:
        if types is not None and any(UInt8Array.coerce(types, "mm_token_type_ids")):
            raise WorkflowOutputError("mm_token_type_ids marks image tokens, but there is no multi_modal_input")
        return None
    if isinstance(mm, Mapping):
        mm = [mm]
    if not isinstance(mm, list) or len(mm) != 1 or not isinstance(mm[0], Mapping):
        raise WorkflowOutputError(
            "multi_modal_input must be a list of one mapping (AReaL's form: the processor's pixel_values and "
            f"image_grid_thw for this sequence), got {type(mm).__name__}"
            + (f" of {len(mm)}" if isinstance(mm, list) else "")
        )
    inputs = mm[0]
    unknown = sorted(str(k) for k in inputs if k not in VISION_KEYS)
    if unknown:
        raise WorkflowOutputError(
            f"multi_modal_input has keys rollq does not carry: {', '.join(unknown)} (it carries pixel_values and "
            "image_grid_thw: images; videos are not supported)"
        )
    pixels, grid = inputs.get("pixel_values"), inputs.get("image_grid_thw")
    if pixels is None or grid is None or not hasattr(pixels, "shape"):
        raise WorkflowOutputError("multi_modal_input needs pixel_values (a tensor or array) and image_grid_thw")
    if types is None:
        raise WorkflowOutputError("a trajectory with multi_modal_input needs mm_token_type_ids (the processor's)")
    token_types = UInt8Array.coerce(types, "mm_token_type_ids")
    if len(token_types) != length:
        raise WorkflowOutputError(f"mm_token_type_ids has {len(token_types)} entries but input_ids has {length}")
    grid_values = Int32Array.coerce(_flat(grid), "image_grid_thw")
    vision = VisionInputs(
        pixel_values=Float32Array.coerce(_flat(pixels), "pixel_values"),
        pixel_shape=[int(d) for d in pixels.shape],
        image_grid_thw=grid_values,
        mm_token_type_ids=token_types,
    )
    payload = Codec().encode(vision)
    return VisionRef(digest=digest_of(payload), size=len(payload), inline=payload)


def _flat(value: Any) -> Any:
    """A tensor or array as a 1-D float/int container (row-major), for the typed arrays' coerce."""
    if hasattr(value, "detach"):  # torch: float32 for pixels (bfloat16 has no numpy view)
        value = value.detach().cpu()
        value = value.float() if value.is_floating_point() else value
        return value.reshape(-1).numpy()
    if hasattr(value, "reshape"):
        return value.reshape(-1)
    return value


def _interactions(output: Mapping[Any, Any]) -> list[Any] | None:
    """The values of an `{id: interaction}` export (each with `to_tensor_dict()`), or None for anything else."""
    if not output or "input_ids" in output:
        return None
    values = list(output.values())
    return values if all(callable(getattr(v, "to_tensor_dict", None)) for v in values) else None


def to_sequences(output: Any, responses: Seq[ModelResponse] = ()) -> list[Sequence] | None:
    """None means the workflow rejected the sample. `responses`: what the engine returned during the episode (for
    the `output_ids` template)."""
    if output is None:
        return None
    used: set[int] = set()
    if isinstance(output, Mapping):
        interactions = _interactions(output)
        if interactions is not None:
            return [to_sequence(i.to_tensor_dict(), responses, used) for i in interactions]
        return [to_sequence(output, responses, used)]
    if isinstance(output, (list, tuple)):
        if not output:
            raise WorkflowOutputError("the workflow returned an empty list (return None to reject a sample)")
        return [to_sequence(item, responses, used) for item in output]
    raise WorkflowOutputError(
        f"arun_episode must return a mapping, a list of mappings or None, got {type(output).__name__}"
    )
